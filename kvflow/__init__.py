"""kvflow: an LLM inference and serving engine.

Public API: ``LLM``, ``LLMEngine``, ``SamplingParams``, ``PoolingParams``, ``EngineArgs``, ``RequestOutput``,
``CompletionOutput``, ``EmbeddingRequestOutput``, ``Logprob``, ``LoRARequest`` (the names of vLLM's, so that a
vLLM script switches by its import line). ``kvflow.LLMEngine`` is vLLM's ``LLMEngine``
(``from_engine_args``, ``add_request(request_id, prompt, params, lora_request=...)``, ``step``);
``kvflow.engine.llm_engine.LLMEngine`` is the engine inside it, which takes token ids.
``kvflow.AsyncLLMEngine`` is vLLM's asyncio engine (``AsyncLLM``: ``from_engine_args(AsyncEngineArgs(...))``,
``async for out in engine.generate(prompt, params, request_id)``), ``kvflow.entrypoints.async_llm``.
"""

# Before anything imports torch: libgomp reads its wait policy once, when torch loads it.
from kvflow.cpu_threads import set_openmp_defaults as _set_openmp_defaults

_set_openmp_defaults()

from kvflow.engine.arg_utils import AsyncEngineArgs, EngineArgs  # noqa: E402
from kvflow.entrypoints.async_llm import AsyncLLMEngine  # noqa: E402
from kvflow.entrypoints.llm import LLM  # noqa: E402
from kvflow.entrypoints.llm import VLLMStyleEngine as LLMEngine  # noqa: E402
from kvflow.inputs import PromptType, TextPrompt, TokensPrompt  # noqa: E402
from kvflow.logprobs import Logprob  # noqa: E402
from kvflow.lora.request import LoRARequest  # noqa: E402
from kvflow.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput  # noqa: E402
from kvflow.pooling_params import PoolingParams  # noqa: E402
from kvflow.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "AsyncEngineArgs", "SamplingParams", "PoolingParams", "EngineArgs", "RequestOutput", "CompletionOutput",
           "EmbeddingRequestOutput", "EmbeddingOutput", "Logprob", "TextPrompt", "TokensPrompt", "PromptType",
           "LoRARequest"]
__version__ = "0.1.0"
