"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, Union

from tqdm.auto import tqdm

from kvflow.config import EngineArgs
from kvflow.engine.llm_engine import LLMEngine
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams

PromptType = Union[str, list[int], dict[str, Any]]
Conversation = list[dict[str, str]]


class LLM:
    """Offline batched generation over the continuous-batching engine.

    Args:
        model: packaged short name (``smollm2-135m``, ``qwen2.5-coder-0.5b``,
            ``qwen2.5-coder-1.5b``), a ``.gguf`` file or a Hugging Face directory.
        **kwargs: any ``EngineArgs`` field (``dtype``, ``block_size``, ``num_kv_blocks``,
            ``kv_cache_memory_bytes``, ``max_num_batched_tokens``, ``max_num_seqs``,
            ``max_model_len``, ``seed``, ...).

    Raises:
        ValueError: for an unknown option or an invalid value (naming the field).
    """

    def __init__(self, model: str = "smollm2-135m", **kwargs: Any) -> None:
        fields = set(EngineArgs.__dataclass_fields__)
        unknown = set(kwargs) - fields
        if unknown:
            raise ValueError(f"unknown LLM option(s) {sorted(unknown)}; known: {sorted(fields)}")
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._counter = itertools.count()

    # ------------------------------------------------------------------ inputs
    def _to_token_ids(self, prompt: PromptType) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt), prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"]), prompt.get("prompt")
            if "prompt" in prompt:
                return self._to_token_ids(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt), None
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    @staticmethod
    def _normalize_prompts(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]
        return list(prompts)

    def _add_all(
        self,
        prompts: list[PromptType],
        params: SamplingParams | Sequence[SamplingParams],
        priority: Sequence[int] | None = None,
    ) -> list[str]:
        if isinstance(params, SamplingParams):
            params_list = [params] * len(prompts)
        else:
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts"
                )
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompts)} prompts")
        encoded = [self._to_token_ids(p) for p in prompts]
        # Validate everything first so that one bad prompt adds nothing.
        for (ids, _), p in zip(encoded, params_list):
            self.engine.validate_prompt(ids, p)
        request_ids = []
        for (ids, text), p, prio in zip(encoded, params_list, priorities):
            request_id = str(next(self._counter))
            self.engine.add_request(request_id, ids, p, prompt=text, priority=prio)
            request_ids.append(request_id)
        return request_ids

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order.

        Args:
            prompts: a string, a list of token ids, a dict with ``prompt`` or
                ``prompt_token_ids``, or a list of these.
            sampling_params: one for all prompts or one per prompt (default
                ``SamplingParams()``).
            use_tqdm: show a progress bar when there is more than one prompt.
            priority: per-prompt priority for the "priority" scheduling policy (lower first).

        Raises:
            ValueError: for an invalid prompt or parameters; nothing is queued then.
        """
        prompt_list = self._normalize_prompts(prompts)
        request_ids = self._add_all(prompt_list, sampling_params or SamplingParams(), priority)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm or len(request_ids) < 2)
        try:
            while len(results) < len(request_ids):
                for output in self.engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        bar.update(1)
        except BaseException:
            for request_id in request_ids:
                if request_id not in results:
                    self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [results[r] for r in request_ids]

    def generate_stream(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield the request's cumulative output after every new token.

        Closing the iterator early aborts the request and frees its blocks.
        """
        (request_id,) = self._add_all([prompt], sampling_params or SamplingParams())
        finished = False
        try:
            while not finished:
                for output in self.engine.step():
                    if output.request_id == request_id:
                        finished = output.finished
                        yield output
        finally:
            if not finished:
                self.engine.abort_request(request_id)

    def apply_chat_template(self, conversation: Conversation) -> list[int]:
        """Token ids of a conversation rendered with the tokenizer's chat template, ending
        with the assistant's generation prompt.

        Raises:
            ValueError: when a message lacks ``role`` or ``content``.
        """
        for message in conversation:
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError("messages must be dicts with 'role' and 'content'")
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations.

        Each conversation is a list of ``{"role": ..., "content": ...}`` messages rendered with
        the tokenizer's chat template.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.apply_chat_template(c)} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_stats(self) -> dict[str, float | int]:
        """See ``LLMEngine.get_stats``."""
        return self.engine.get_stats()
