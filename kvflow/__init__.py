"""kvflow: an LLM inference and serving engine.

Public API: ``LLM``, ``SamplingParams``, ``EngineArgs``, ``RequestOutput``, ``CompletionOutput``.
"""

from kvflow.config import EngineArgs
from kvflow.entrypoints.llm import LLM
from kvflow.outputs import CompletionOutput, RequestOutput
from kvflow.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
