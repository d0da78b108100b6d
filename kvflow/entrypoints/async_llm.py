"""vLLM's ``AsyncLLM`` (``vllm.AsyncLLMEngine``) on kvflow: ``AsyncLLM.from_engine_args(
AsyncEngineArgs(...))`` and ``async for output in engine.generate(prompt, sampling_params,
request_id)``, so that a script written for vLLM's asyncio engine runs by changing its import
(``from kvflow import AsyncEngineArgs, AsyncLLMEngine``).

It is the server's engine thread (``kvflow.engine.async_engine.AsyncLLMEngine``) over an
``LLM``'s engine: requests from any number of coroutines are batched together, each
``generate`` iterator yields its request's outputs as ``sampling_params.output_kind`` asks
(CUMULATIVE by default, DELTA: the new tokens only, FINAL_ONLY: the last output), and leaving
the iterator early aborts the request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from kvflow.engine.arg_utils import AsyncEngineArgs, EngineArgs
from kvflow.entrypoints.llm import LLM, PromptType, _refuse_unset
from kvflow.lora.request import LoRARequest
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams

__all__ = ["AsyncEngineArgs", "AsyncLLM", "AsyncLLMEngine"]


class AsyncLLM:
    """vLLM's asyncio engine (see the module docstring).

    Args:
        llm: the ``LLM`` whose engine this runs (its engine thread starts here).
    """

    def __init__(self, llm: LLM) -> None:
        from kvflow.engine.async_engine import AsyncLLMEngine as _EngineThread

        self._llm = llm
        self.tokenizer = llm.tokenizer
        self._core = _EngineThread(llm.engine, model_name=str(llm.engine.config.load.model_dir))
        self._core.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, start_engine_loop: bool = True, usage_context: Any = None,
                         stat_loggers: Any = None, **kwargs: Any) -> "AsyncLLM":
        """Load the model and start the engine thread (vLLM's ``AsyncLLM.from_engine_args``);
        ``start_engine_loop``, ``usage_context`` and ``stat_loggers`` are accepted and not
        used.

        Raises:
            ValueError: see ``LLM.from_engine_args``; an unknown keyword, naming it.
        """
        if kwargs:
            raise ValueError(f"AsyncLLM.from_engine_args: {', '.join(sorted(kwargs))} is not supported by kvflow")
        return cls(LLM.from_engine_args(engine_args))

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Any = None,
        data_parallel_rank: int | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they are made (vLLM's ``AsyncLLM.generate``):
        ``sampling_params.output_kind`` says what each holds; the last one has ``finished``.
        Closing the iterator early (``break``) aborts the request. ``trace_headers`` is
        accepted and not used.

        Raises:
            ValueError: for a prompt, parameters or adapter the engine refuses (naming the
                field), a request_id already in use, ``tokenization_kwargs`` or a
                ``data_parallel_rank`` (one engine).
        """
        _refuse_unset(tokenization_kwargs=tokenization_kwargs)
        if data_parallel_rank is not None:
            raise ValueError("data_parallel_rank is not supported by kvflow (one engine per process); leave it unset")
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}")
        if priority != 0 and self._llm.engine.scheduler_config.policy != "priority":
            raise ValueError(f"priority={priority} needs the priority scheduling policy (scheduling_policy="
                             f"'priority')")
        ids, text = await self._core.run_off_loop(self._llm._to_token_ids, prompt)
        prepared = await self._core.prepare(ids, sampling_params, lora_request)
        (outputs,) = self._core.add_requests([(str(request_id), prepared, text)], priority=priority)
        async for output in outputs:
            yield output

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort one request or several (vLLM's ``AsyncLLM.abort``)."""
        for one in [request_id] if isinstance(request_id, str) else request_id:
            self._core.abort(str(one))

    async def get_tokenizer(self) -> Any:
        """The model's tokenizer (vLLM's coroutine)."""
        return self.tokenizer

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter ahead of its requests (vLLM's ``add_lora``)."""
        return await self._core.run_off_loop(self._llm.engine.add_lora, lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        """Forget adapter ``lora_id`` between two steps (vLLM's ``remove_lora``)."""
        return await self._core.call_on_engine(self._llm.engine.remove_lora, lora_id)

    async def list_loras(self) -> set[int]:
        return await self._core.call_on_engine(self._llm.engine.list_loras)

    async def reset_prefix_cache(self) -> bool:
        return await self._core.call_on_engine(self._llm.engine.reset_prefix_cache)

    @property
    def is_running(self) -> bool:
        return self._core.is_healthy

    @property
    def errored(self) -> bool:
        return self._core.error is not None

    def shutdown(self) -> None:
        """Stop the engine thread (open requests fail) and the engine's workers."""
        self._core.shutdown()
        self._llm.shutdown()


# vLLM's top-level name of its asyncio engine (``vllm.AsyncLLMEngine`` is ``AsyncLLM``).
AsyncLLMEngine = AsyncLLM
