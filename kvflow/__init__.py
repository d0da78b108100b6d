"""kvflow: an LLM inference and serving engine.

Public API: ``LLM``, ``SamplingParams``, ``EngineArgs``, ``RequestOutput``, ``CompletionOutput``.
"""

# Before anything imports torch: libgomp reads its wait policy once, when torch loads it.
from kvflow.cpu_threads import set_openmp_defaults as _set_openmp_defaults

_set_openmp_defaults()

from kvflow.config import EngineArgs  # noqa: E402
from kvflow.entrypoints.llm import LLM  # noqa: E402
from kvflow.outputs import CompletionOutput, RequestOutput  # noqa: E402
from kvflow.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
