"""The OpenAI endpoints' request handling (``OpenAIServing``: completions and chat
completions, streamed or whole, with tools, reasoning and logprobs) and the helpers the other
APIs' handlers share (``kvflow.entrypoints.openai.serving_responses``,
``serving_embedding``, ``serving_tokenization``, ``kvflow.entrypoints.anthropic``). The app,
its routes and middlewares are in ``server.py``; errors in ``errors.py``.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from kvflow.engine.async_engine import (
    AsyncLLMEngine, EngineDeadError, QueueFullError, QueueTooSmallError, RequestFailedError,
)  # fmt: skip
from kvflow.entrypoints.openai.chat_output import ChatOutputParser, ChatRun
from kvflow.entrypoints.openai.errors import APIError
from kvflow.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice, _short
from kvflow.entrypoints.openai.reasoning import get_reasoning_parser
from kvflow.entrypoints.openai.tool_parsers import (
    JSONArrayToolParser, NamedFunctionParser, ToolParser, detect_tool_parser, get_tool_parser,
)  # fmt: skip
from kvflow.entrypoints.openai.tools import template_tools, tool_call_structural_tag, tool_schema_error
from kvflow.lora.request import LoRARequest
from kvflow.outputs import RequestOutput
from kvflow.pooling_params import PoolingParams
from kvflow.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
# Prompts per request (a list of prompts in /v1/completions, a list of inputs in
# /v1/embeddings): OpenAI's limit for an array input ("2048 dimensions or less"); each is one
# engine request, so that one body cannot fill the queue by itself.
MAX_PROMPTS = 2048


def _bad_request(exc: ValueError) -> APIError:
    message = str(exc)
    # the message's first word names the field: "response_format.json_schema.schema ..." the
    # top-level field response_format, "stop: an entry of ..." the field stop
    head = re.split(r"[.\[:]", message.split(" ", 1)[0], maxsplit=1)[0] if message else ""
    param = head if head.isidentifier() else None
    return APIError(400, message, "BadRequestError", param)


def _refuse_unsupported(req: Any) -> None:
    """Raises APIError 400 naming the first field of ``req`` kvflow does not implement."""
    unsupported = req.unsupported_field()
    if unsupported is not None:
        raise APIError(400, unsupported[1], "BadRequestError", unsupported[0])


@contextlib.contextmanager
def _renamed(renames: dict[str, str]) -> Iterator[None]:
    """An ``APIError`` raised inside names the other API's field (``renames``: chat field ->
    that field)."""
    try:
        yield
    except APIError as exc:
        if exc.param in renames:
            exc.message = exc.message.replace(exc.param, renames[exc.param])
            exc.param = renames[exc.param]
        raise


def _name_constraint(exc: APIError, req: Any) -> APIError:
    """``exc``, naming the field the request set when it is about the ``guided_*`` field
    that field became (``response_format`` and ``structured_outputs`` are compiled as
    ``guided_json`` etc.)."""
    if exc.param and exc.param.startswith("guided_") and getattr(req, exc.param, None) is None:
        field = req.output_constraint()
        if field is not None:
            exc.message, exc.param = f"{field}: {exc.message}", field
    return exc


_CONSTRAINT_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag")


def _as_api_error(exc: BaseException) -> APIError:
    """The API error for a fault after admission (or any other)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestFailedError):
        if exc.failure.is_invalid_request:
            # a constraint that failed during generation names its field ("ValueError: guided_regex ...")
            param = _bad_request(ValueError(exc.failure.message.removeprefix("ValueError: "))).param
            param = param if param in _CONSTRAINT_FIELDS else None
            return APIError(400, f"the request failed: {exc.failure.message}", "BadRequestError", param)
        return APIError(500, f"the request failed inside the engine: {exc.failure.message}", "InternalServerError")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "ServiceUnavailableError")
    logger.error("internal error: %s: %s", type(exc).__name__, exc, exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "InternalServerError")


# ---------------------------------------------------------------------------- request bodies

def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's ``usage``; ``prompt_tokens_details.cached_tokens`` counts the prompt tokens
    that were prefix-cache hits (``RequestOutput.num_cached_tokens``, summed over prompts)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _chat_finish_reason(finish_reason: str | None, parser: ChatOutputParser) -> str | None:
    """A reply that ended by itself after tool calls finished with "tool_calls"."""
    return "tool_calls" if finish_reason == "stop" and parser.tool_calls else finish_reason


def _chat_delta(delta) -> dict[str, Any]:
    """A ``ChatDelta`` as a chat.completion.chunk delta (OpenAI's shape: a tool call has its
    index, id, type, name and arguments; kvflow sends each call whole, once complete)."""
    out: dict[str, Any] = {}
    if delta.reasoning:
        out["reasoning_content"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        calls = []
        for t in delta.tool_calls:
            calls.append({"index": t.index, "id": t.id, "type": "function",
                          "function": {"name": t.name, "arguments": t.arguments}})
        out["tool_calls"] = calls
    return out


def response_id(prefix: str, req: Any, raw: Request | None) -> str:
    """The answer's id, as vLLM's server makes it: ``{prefix}-`` and the request's
    ``X-Request-Id`` header, else its ``request_id`` field (vLLM's), else a random hex id.

    Raises:
        APIError: 400 naming request_id, for one that is no non-empty string.
    """
    header = raw.headers.get("x-request-id") if raw is not None else None
    if header:
        return f"{prefix}-{header}"
    given = (req.model_extra or {}).get("request_id")
    if given is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    if not isinstance(given, str) or not given:
        raise APIError(400, f"request_id must be a non-empty string, got {_short(given)}", "BadRequestError",
                       "request_id")
    return f"{prefix}-{given}"


class _TextOffsets:
    """Completions' ``text_offset``: each token's offset, in characters, in the response's
    text, counted from the tokens' own UTF-8 bytes. A token holding part of a character
    decodes alone to U+FFFD (one character, while the text holds one for all its bytes): it
    is at the offset of the character it is part of, so the offsets stay within the text
    (counting each token's decoded text ran past it, one per byte of a multi-byte character)."""

    def __init__(self) -> None:
        self.offset = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def next(self, token_bytes: list[int]) -> int:
        """The offset of the token of ``token_bytes``, the next token of the response."""
        offset = self.offset
        self.offset += len(self._decoder.decode(bytes(token_bytes)))
        return offset


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class _TextChunk:
    """The SSE event of a streamed chunk whose only varying part is one string field, from
    ``payload`` serialized once: ``chunk(text)`` is byte for byte ``_sse(payload with that
    field = text)`` (``json.dumps``' default separators, ``ensure_ascii=False``), for the cost
    of one string's ``json.dumps``, not the whole chunk's.

    Args:
        payload: the chunk with the varying field set to ``""`` as the last key of the last
            object in it (e.g. ``{..., "choices": [{"index": 0, "text": ""}]}``).

    Raises:
        ValueError: when the serialized payload does not end with that empty field.
    """

    def __init__(self, payload: dict[str, Any]) -> None:
        data = json.dumps(payload, ensure_ascii=False)
        head, sep, tail = data.rpartition('""')
        if not sep or tail.strip("]}") != "":
            raise ValueError(f"the payload does not end with an empty string field: {data[-40:]!r}")
        self.head, self.tail = f"data: {head}", f"{tail}\n\n"

    def __call__(self, text: str) -> str:
        return self.head + json.dumps(text, ensure_ascii=False) + self.tail


async def _guard_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Forward an SSE stream; a fault ends it with an error event and ``[DONE]``."""
    try:
        async for event in events:
            yield event
    except Exception as exc:  # noqa: BLE001 - reported to the client in the stream
        yield _sse(_as_api_error(exc).body())
        yield _sse("[DONE]")


async def _merge(iterators: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams, tagging each item with its stream index.

    One stream (the common case) is read directly, without a pump task and a second queue
    between the engine's stream and the consumer (one task switch fewer per output)."""
    if len(iterators) == 1:
        (it,) = iterators
        try:
            async for item in it:
                yield 0, item
        finally:
            await it.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[RequestOutput]) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for it in iterators:
            # One that its pump is still awaiting is closed (and its request aborted) by the
            # pump's cancellation; aclose() on it would raise "already running".
            if not getattr(it, "ag_running", False):
                await it.aclose()


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (``bytes_to_unicode``) inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class OpenAIServing:
    """Request handling shared by the endpoints.

    Args:
        engine: the started async engine.
        model_name: the served model id (``/v1/models``, the ``model`` field).
        max_model_len: context limit in tokens.
        model_aliases: other ``model`` values accepted for it (e.g. the ``--model`` path).
        chat_template: a Jinja chat template used instead of the tokenizer's.
        tool_parser: the ``--tool-call-parser`` name (None: the family detected from the chat
            template, else ``generic``, which reads the forms most models write calls in).
        reasoning_parser: the ``--reasoning-parser`` name (None: no reasoning split).

    Raises:
        ValueError: naming the flag, for an unknown tool or reasoning parser.
    """

    def __init__(self, engine: AsyncLLMEngine, model_name: str, max_model_len: int,
                 model_aliases: tuple[str, ...] = (), chat_template: str | None = None,
                 tool_parser: str | None = None, reasoning_parser: str | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.chat_template = chat_template
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        self.tool_parser_cls: type[ToolParser] = (
            get_tool_parser(tool_parser) if tool_parser else detect_tool_parser(template if isinstance(template, str) else None)
        )
        self.reasoning_parser_cls = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        self.model_name = model_name
        self.model_names = {model_name, *model_aliases}
        # LoRA adapters served under their own model names (``--lora-modules``, and
        # /v1/load_lora_adapter at run time), each a ``LoRARequest`` with a fresh id.
        self.lora_modules: dict[str, LoRARequest] = {}
        self._lora_ids = itertools.count(1)
        self.max_model_len = max_model_len
        self.defaults = dict(engine.engine.generation_defaults)
        kv = engine.engine.kv_cache_manager
        # Tokens one sequence can ever hold: the default max_tokens must fit the KV cache too.
        self.max_seq_tokens = min(max_model_len, kv.num_total_blocks * kv.block_size)

    # ------------------------------------------------------------------ helpers
    def check_request(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        """The model exists and every field set is one kvflow implements.

        Raises:
            APIError: 404 for an unknown model, 400 naming an unsupported field.
        """
        if req.model is not None and req.model not in self.model_names and req.model not in self.lora_modules:
            raise APIError(404, f"The model `{req.model}` does not exist.", "NotFoundError", "model")
        _refuse_unsupported(req)
        self._check_reasoning_format(req)

    def _check_reasoning_format(self, req: Any) -> None:
        """llama-server's ``reasoning_format`` where this server does what it asks: ``"auto"``,
        ``"none"`` (the reasoning left in the content) without ``--reasoning-parser``,
        ``"deepseek"`` / ``"deepseek-legacy"`` (split into ``reasoning_content``) with one.

        Raises:
            APIError: 400 naming ``reasoning_format`` for any other value (it was dropped).
        """
        value = (req.model_extra or {}).get("reasoning_format")
        if value is None or value == "auto" or not isinstance(req, ChatCompletionRequest):
            return  # (llama-server reads it on chat completions only)
        splits = self.reasoning_parser_cls is not None
        if value == "none" and not splits or value in ("deepseek", "deepseek-legacy") and splits:
            return
        does = ("splits the reasoning into reasoning_content (--reasoning-parser)" if splits
                else "leaves the reasoning in the content (no --reasoning-parser)")
        raise APIError(400, f"reasoning_format {_short(value)} is not supported by kvflow: this server {does}; "
                            "leave it unset", "BadRequestError", "reasoning_format")

    def _max_tokens(self, requested: int | None, prompt_len: int, field: str, prompt_field: str) -> int:
        """``requested``, checked against the context; for an unset one, what is left of the
        context (capped by the model's generation-config ``max_tokens``).

        Raises:
            APIError: 400 naming ``field`` for a value below 1 or one the context has no room
                for; naming ``prompt_field`` (``prompt``, ``messages``) for a prompt that
                leaves no room for any output (no ``max_tokens`` would fit: naming it misled).
        """
        if requested is None:
            left = max(self.max_seq_tokens - prompt_len, 1)
            return min(left, self.defaults.get("max_tokens", left))
        if requested < 1:
            raise APIError(400, f"{field} must be at least 1, got {requested}", "BadRequestError", field)
        if prompt_len >= self.max_model_len:  # (the engine's check and message, for an unset max_tokens)
            raise APIError(400, f"prompt is {prompt_len} tokens; it must be shorter than "
                                f"max_model_len={self.max_model_len} to leave room for output", "BadRequestError",
                           prompt_field)  # fmt: skip
        if prompt_len + requested > self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the messages, {requested} in the completion).",
                "BadRequestError",
                field,
            )
        return requested

    def truncate(self, prompts: list[tuple[list[int], str | None]], k: int | None,
                 pooling: bool = False) -> list[tuple[list[int], str | None]]:
        """The prompts as vLLM's ``truncate_prompt_tokens`` leaves them (their last ``k``
        tokens: ``LLMEngine.truncate_prompt``); a truncated prompt loses its text (an echo
        decodes the ids kept).

        Raises:
            APIError: 400 naming ``truncate_prompt_tokens`` for a bad value or one above
                ``max_model_len``.
        """
        if k is None:
            return prompts
        engine = self.engine.engine
        try:
            kept = [engine.truncate_prompt(ids, k, pooling) for ids, _ in prompts]
        except ValueError as exc:
            raise APIError(400, str(exc), "BadRequestError", "truncate_prompt_tokens") from None
        return [(ids, text if len(ids) == len(old) else None) for ids, (old, text) in zip(kept, prompts)]

    def _params(self, req, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
        try:
            return req.sampling_params(max_tokens, logprobs, prompt_logprobs, self.defaults)
        except ValueError as exc:
            raise _bad_request(exc) from None

    def served_name(self, model: str | None) -> str:
        """The ``model`` a response names: the adapter's name for an adapter, else the base
        model's served name."""
        return model if model in self.lora_modules else self.model_name

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names, or None for the base model."""
        return self.lora_modules.get(model) if model is not None else None

    def register_lora(self, name: str, path: str) -> LoRARequest:
        """Read, check and serve the PEFT adapter at ``path`` as model ``name`` (blocking:
        at start-up, or off the loop).

        Raises:
            ValueError: a name already served, LoRA not enabled, or an adapter the engine
                refuses (``LLMEngine.check_lora_request``, naming it and the module).
        """
        if name in self.model_names or name in self.lora_modules:
            raise ValueError(f"lora_name: the model name {name!r} is already served")
        lora = LoRARequest(name, next(self._lora_ids), path)
        self.engine.engine.add_lora(lora)
        if name in self.lora_modules:  # (loaded twice at once: the first one wins)
            raise ValueError(f"lora_name: the model name {name!r} is already served")
        self.lora_modules[name] = lora
        return lora

    async def load_lora_adapter(self, name: str, path: str) -> LoRARequest:
        """/v1/load_lora_adapter: ``register_lora`` off the loop.

        Raises:
            APIError: 400 naming the field (``lora_name``, ``lora_path``).
        """
        try:
            return await self.engine.run_off_loop(self.register_lora, name, path)
        except ValueError as exc:
            field = "lora_name" if str(exc).startswith("lora_name") else "lora_path"
            raise APIError(400, str(exc), "BadRequestError", field) from None

    async def unload_lora_adapter(self, name: str) -> None:
        """/v1/unload_lora_adapter: stop serving ``name`` and drop the adapter (on the engine
        thread, between steps).

        Raises:
            APIError: 404 for a name not loaded; 400 while unfinished requests use it (it is
                never pulled from under them); 503 once the engine has stopped.
        """
        lora = self.lora_modules.get(name)
        if lora is None:
            raise APIError(404, f"The LoRA adapter `{name}` is not loaded.", "NotFoundError", "lora_name")
        try:
            await self.engine.call_on_engine(self.engine.engine.remove_lora, lora.lora_int_id)
        except ValueError as exc:
            raise APIError(400, str(exc), "BadRequestError", "lora_name") from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "ServiceUnavailableError") from None
        self.lora_modules.pop(name, None)

    async def _add(self, prompts: list[tuple[list[int], str | None]], params: SamplingParams | PoolingParams,
                   prompt_field: str, priority: int | None = None,
                   lora_request: LoRARequest | None = None,
                   max_tokens_field: str = "max_tokens") -> list[AsyncIterator[RequestOutput]]:
        """Prepare every prompt off the loop, then queue them all or none (with one
        scheduling ``priority``, vLLM's extension: lower runs first; ``lora_request``: the
        adapter the request's ``model`` names).

        Raises:
            APIError: 400 for a prompt or parameters the engine refuses (a prompt's fault
                names ``prompt_field``, one of max_tokens against the KV cache ``max_tokens_field``),
                or a ``priority`` other than 0 when the server runs
                ``--scheduling-policy fcfs``; 429 when the queue cannot take them all, 503
                once the engine has stopped.
        """
        engine = self.engine.engine
        policy = engine.scheduler_config.policy
        if priority and policy != "priority":
            raise APIError(400, f"priority is set ({priority}) but the server schedules {policy!r}: start it with "
                           "--scheduling-policy priority, or leave priority unset", "BadRequestError", "priority")
        try:
            prepared = await self.engine.run_off_loop(
                lambda: [engine.prepare_request(ids, params, lora_request) for ids, _ in prompts])
        except ValueError as exc:
            error = _bad_request(exc)
            if error.param in ("prompt", "prompt_token_ids"):
                error.param = prompt_field
            elif error.param == "max_tokens":  # (prompt + max_tokens needing more than the whole KV cache)
                error.param = max_tokens_field
            elif lora_request is not None and error.message.startswith(f"LoRA adapter {lora_request.lora_name!r}"):
                error.param = "model"  # (the adapter the request's model names no longer loads: its folder changed)
            raise error from None
        request_id = uuid.uuid4().hex
        try:
            return self.engine.add_requests(
                [(f"{request_id}-{i}", p, text) for i, (p, (_, text)) in enumerate(zip(prepared, prompts))],
                priority=priority or 0,
            )
        except QueueTooSmallError as exc:  # can never fit: not a 429 to retry
            raise APIError(400, str(exc), "BadRequestError", prompt_field) from None
        except QueueFullError as exc:
            raise APIError(429, str(exc), "RateLimitError", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "ServiceUnavailableError") from None

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _token_bytes(self, token_id: int, text: str) -> list[int]:
        """A token's own UTF-8 bytes (chat logprobs' ``bytes``, which OpenAI gives so that a
        character split over tokens can be put together again): a token holding part of a
        character decodes alone to U+FFFD, whose bytes are not the token's; its piece is read
        as a byte-level BPE piece (GPT-2's byte-to-character map) or a ``<0xNN>`` byte token."""
        if "\ufffd" in text:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece:
                if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    try:
                        return [int(piece[3:5], 16)]
                    except ValueError:
                        pass
                decoder = _byte_level_decoder()
                if all(ch in decoder for ch in piece):
                    return [decoder[ch] for ch in piece]
        return list(text.encode("utf-8"))

    # ------------------------------------------------------------------ completions
    def _completion_prompts(self, req: CompletionRequest) -> list[tuple[list[int], str | None]]:
        """(token ids, text or None) per prompt of ``req``.

        Raises:
            APIError: 400 naming ``prompt`` for an empty one or a list of more than
                ``MAX_PROMPTS`` prompts.
        """
        p = req.prompt
        if isinstance(p, str):
            return [(self.tokenizer.encode(p), p)]
        if not p:
            raise APIError(400, "prompt must not be empty", "BadRequestError", "prompt")
        if not isinstance(p[0], int) and len(p) > MAX_PROMPTS:
            raise APIError(400, f"prompt has {len(p)} prompts; at most {MAX_PROMPTS} per request", "BadRequestError",
                           "prompt")
        if all(isinstance(x, int) for x in p):
            return [(list(p), None)]
        if all(isinstance(x, str) for x in p):
            return [(self.tokenizer.encode(x), x) for x in p]
        return [(list(x), None) for x in p]

    def _completion_logprobs(self, token_ids: list[int], entries: list[dict[int, float] | None],
                             offsets: _TextOffsets) -> dict[str, Any]:
        tokens, token_logprobs, top, text_offset = [], [], [], []
        for tok, entry in zip(token_ids, entries):
            text = self._token_text(tok)
            tokens.append(text)
            token_logprobs.append(None if entry is None else entry[tok])
            top.append(None if entry is None else {self._token_text(t): lp for t, lp in entry.items()})
            text_offset.append(offsets.next(self._token_bytes(tok, text)))
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offset}

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_request(req)
        cid = response_id("cmpl", req, raw)
        prompts = self.truncate(await self.engine.run_off_loop(self._completion_prompts, req),
                                req.truncate_prompt_tokens)
        if "max_tokens" in req.model_fields_set:
            requested = req.max_tokens  # null: what is left of the context
        else:  # the model's generation-config default, else OpenAI's 16
            requested = None if "max_tokens" in self.defaults else 16
        max_tokens = max(self._max_tokens(requested, len(ids), "max_tokens", "prompt") for ids, _ in prompts)
        prompt_logprobs = req.logprobs if (req.echo and req.logprobs is not None) else None
        params = self._params(req, max_tokens, req.logprobs, prompt_logprobs)
        try:
            iterators = await self._add(prompts, params, "prompt", req.priority, self.lora_for(req.model))
        except APIError as exc:
            raise _name_constraint(exc, req) from None
        created = int(time.time())
        n = params.n
        if req.stream:
            return StreamingResponse(
                _guard_stream(self._stream_completion(iterators, prompts, req, cid, created, n)),
                media_type="text/event-stream",
            )
        finals = await self._collect(iterators, raw)
        choices = []
        completion_tokens = 0
        for p_idx, (out, (ids, text)) in enumerate(zip(finals, prompts)):
            prompt_text = text if text is not None else self.tokenizer.decode(ids)
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                choice: dict[str, Any] = {
                    "index": p_idx * n + c.index,
                    "text": (prompt_text if req.echo else "") + c.text,
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                }
                if c.stop_reason is not None:
                    choice["stop_reason"] = c.stop_reason
                if req.logprobs is not None:
                    tokens, entries = list(c.token_ids), list(c.logprobs or [])
                    if req.echo:
                        tokens, entries = ids + tokens, list(out.prompt_logprobs or [None] * len(ids)) + entries
                    choice["logprobs"] = self._completion_logprobs(tokens, entries, _TextOffsets())
                choices.append(choice)
        prompt_tokens = sum(len(ids) for ids, _ in prompts)
        return JSONResponse(
            {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": self.served_name(req.model),
                "choices": choices,
                "usage": _usage(prompt_tokens, completion_tokens, sum(out.num_cached_tokens for out in finals)),
            }
        )

    async def _stream_completion(self, iterators, prompts, req: CompletionRequest, cid: str, created: int, n: int):
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        # index -> the text_offset count of its logprobs entries so far: counted as the whole
        # response counts it (the echoed prompt's first)
        offsets: dict[int, _TextOffsets] = {}
        completion_tokens = 0
        cached: dict[int, int] = {}  # prompt index -> its prefix-cache hits
        base = {"id": cid, "object": "text_completion", "created": created, "model": self.served_name(req.model)}
        text_chunks: dict[int, _TextChunk] = {}  # index -> its text-only chunk, serialized once
        finished: set[int] = set()  # choices whose finish was sent (n > 1: later outputs repeat them)
        async for p_idx, out in _merge(iterators):
            cached[p_idx] = out.num_cached_tokens
            for c in out.outputs:
                index = p_idx * n + c.index
                if index in finished:
                    continue
                start_text, start_tok = sent_text.get(index, 0), sent_tokens.get(index, 0)
                delta = c.text[start_text:]
                new_tokens = c.token_ids[start_tok:]
                echo_now = req.echo and index not in sent_tokens
                if echo_now and req.logprobs is not None and out.prompt_logprobs is None and not out.finished:
                    # the first chunk carries the prompt's logprobs, which the engine gives
                    # from the first output on (once the prompt's last chunk is computed, as
                    # vLLM): never hit then, a guard (the outputs are cumulative)
                    continue
                # tokens without text yet (part of a multi-byte character) wait for their
                # text, unless their logprobs are asked for
                if not delta and not echo_now and c.finish_reason is None and (req.logprobs is None or not new_tokens):
                    continue
                tokens, entries = new_tokens, (c.logprobs or [])[start_tok:]
                if echo_now:
                    ids, text = prompts[p_idx]
                    delta = (text if text is not None else self.tokenizer.decode(ids)) + delta
                    # the first chunk carries the prompt's entries too, as the whole response
                    tokens, entries = ids + tokens, list(out.prompt_logprobs or [None] * len(ids)) + entries
                # OpenAI's schema requires logprobs and finish_reason on every choice (null unset)
                choice: dict[str, Any] = {"index": index, "text": delta, "logprobs": None, "finish_reason": None}
                if req.logprobs is not None and tokens:
                    choice["logprobs"] = self._completion_logprobs(
                        tokens, entries, offsets.setdefault(index, _TextOffsets()))
                if c.finish_reason is not None:
                    choice["finish_reason"] = c.finish_reason
                    if c.stop_reason is not None:
                        choice["stop_reason"] = c.stop_reason
                sent_text[index], sent_tokens[index] = len(c.text), len(c.token_ids)
                if c.finish_reason is not None:
                    completion_tokens += len(c.token_ids)
                    finished.add(index)
                if len(choice) == 4 and choice["logprobs"] is None and choice["finish_reason"] is None:
                    # text only (logprobs and finish_reason null): most chunks of a stream
                    chunk = text_chunks.get(index)
                    if chunk is None:
                        chunk = text_chunks[index] = _TextChunk(
                            {**base, "choices": [{"index": index, "logprobs": None, "finish_reason": None, "text": ""}]})
                    yield chunk(delta)
                else:
                    yield _sse({**base, "choices": [choice]})
        if req.stream_options is not None and req.stream_options.include_usage:
            prompt_tokens = sum(len(ids) for ids, _ in prompts)
            yield _sse({**base, "choices": [], "usage": _usage(prompt_tokens, completion_tokens, sum(cached.values()))})
        yield _sse("[DONE]")

    # ------------------------------------------------------------------ chat
    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        messages = [m.template_dict() for m in req.messages]
        kwargs: dict[str, Any] = dict(req.chat_template_kwargs or {})
        if req.tools:
            kwargs["tools"] = template_tools(req.tools)
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, **kwargs)
        except Exception as exc:  # noqa: BLE001 - template errors are the client's messages
            raise APIError(400, f"messages could not be rendered with the chat template: {exc}", "BadRequestError", "messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _output_parsers(self, req: ChatCompletionRequest) -> tuple[Callable[..., ChatOutputParser], bool]:
        """The maker of a chat request's output parsers (one per choice; its argument is the
        tool call id prefix), and whether the text must keep special tokens."""
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        forced = choice not in ("none", "auto")
        tool_parser: Callable[[], ToolParser] | None = None
        if req.tools and choice == "auto":
            tool_parser = self.tool_parser_cls
        elif choice == "required":
            tool_parser = JSONArrayToolParser
        elif isinstance(choice, NamedToolChoice):
            name = choice.function.name
            tool_parser = lambda: NamedFunctionParser(name)  # noqa: E731
        keep_special = tool_parser is not None and tool_parser is self.tool_parser_cls and tool_parser.needs_special_tokens
        reasoning = None if forced else self.reasoning_parser_cls  # a forced call is JSON from its first token
        max_calls = 1 if req.parallel_tool_calls is False else None
        # (the EOS that ends a request is not in its text: OutputProcessor, as vLLM)

        def make(id_prefix: str = "call_") -> ChatOutputParser:
            return ChatOutputParser(reasoning() if reasoning else None, tool_parser() if tool_parser else None,
                                    max_calls, id_prefix=id_prefix)

        return make, keep_special

    def _tool_call_constraint(self, req: ChatCompletionRequest, params: SamplingParams) -> dict[str, Any] | None:
        """The structural tag that constrains the calls of a ``tool_choice: "auto"`` request
        (``tools.tool_call_structural_tag``), or None: no tools, another tool_choice, a
        request with its own output constraint, or a parser without call forms."""
        choice = req.tool_choice if req.tool_choice is not None else "auto"
        if not req.tools or choice != "auto" or params.guided_kind is not None:
            return None
        return tool_call_structural_tag(req.tools, self.tool_parser_cls.call_forms)

    async def start_chat(self, req: ChatCompletionRequest) -> ChatRun:
        """Check, render (off the loop) and queue a chat request.

        Raises:
            APIError: 400 / 404 / 429 / 503 as ``check_request``, ``_output_parsers`` and ``_add``.
        """
        self.check_request(req)
        make_parser, keep_special = self._output_parsers(req)
        if keep_special:
            req = req.model_copy(update={"skip_special_tokens": False})
        ((ids, _),) = self.truncate([(await self.engine.run_off_loop(self._chat_prompt, req), None)],
                                    req.truncate_prompt_tokens)
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self._max_tokens(requested, len(ids), field, "messages")
        top_k = req.top_logprobs or 0
        params = self._params(req, max_tokens, top_k if req.logprobs else None)
        tag = self._tool_call_constraint(req, params)
        if tag is not None:
            params = dataclasses.replace(params, structural_tag=tag)
        elif req.tools:  # no call constraint of theirs built here: their schemas checked alone
            error = await self.engine.run_off_loop(tool_schema_error, req.tools)
            if error is not None:
                raise APIError(400, error, "BadRequestError", "tools")
        try:
            (iterator,) = await self._add([(ids, None)], params, "messages", req.priority, self.lora_for(req.model),
                                          max_tokens_field=field)
        except APIError as exc:
            if exc.param in ("guided_json", "structural_tag") and req.tools and (
                    req.output_constraint() in (None, "tool_choice")):
                # the tool whose schema the grammar engine refuses, named (the constraint of
                # every tool's calls only said where in its own grammar: "at 5(8)")
                named = await self.engine.run_off_loop(tool_schema_error, req.tools)
                if named is not None:
                    raise APIError(400, named, "BadRequestError", "tools") from None
                raise APIError(400, f"tools: a parameter schema cannot be enforced for tool_choice ({exc.message})",
                               "BadRequestError", "tools") from None
            raise _name_constraint(exc, req) from None
        return ChatRun(ids, iterator, make_parser)

    def translate_chat(self, req: Any, to_chat_fields: Callable[[Any], dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request that a validated request of another API (``req``: a responses
        or Anthropic messages body) means.

        Its own unsupported fields are refused by the callers first (``_refuse_unsupported``,
        outside the renaming, so that the error names the field as the client sent it).

        Raises:
            APIError: 400 naming the field whose translation failed (a ValueError whose
                message starts with the field's name), or the chat field the translation
                does not validate as.
        """
        try:
            fields = to_chat_fields(req)
        except ValueError as exc:
            raise APIError(400, str(exc), "BadRequestError", re.match(r"[a-z_]*", str(exc)).group() or None) from None
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(x) for x in first["loc"])
            raise APIError(400, f"{loc}: {first['msg']}", "BadRequestError", str(first["loc"][0])) from None

    async def start_translated_chat(self, req: Any, to_chat_fields: Callable[[Any], dict[str, Any]],
                                    renames: dict[str, str]) -> ChatRun:  # fmt: skip
        """Queue a validated request of another API as the chat request
        ``to_chat_fields(req)`` describes (``translate_chat``); an error names the other
        API's field (``renames``: chat field -> that field).

        Raises:
            APIError: 400 naming a field ``req`` does not implement (as sent); see
                ``translate_chat`` and ``start_chat``, with the field renamed.
        """
        _refuse_unsupported(req)  # (named as the client sent it: before the renames apply)
        with _renamed(renames):
            return await self.start_chat(self.translate_chat(req, to_chat_fields))

    async def count_translated_chat_tokens(self, req: Any, to_chat_fields: Callable[[Any], dict[str, Any]],
                                           renames: dict[str, str]) -> int:  # fmt: skip
        """The prompt tokens ``start_translated_chat`` would queue for ``req`` (the chat
        template's rendering, with the tools), without generating.

        Raises:
            APIError: 400 naming a field ``req`` does not implement (as sent); see
                ``translate_chat`` and ``check_request``; 400 naming messages for a template
                failure; with the field renamed.
        """
        _refuse_unsupported(req)  # (named as the client sent it: before the renames apply)
        with _renamed(renames):
            chat = self.translate_chat(req, to_chat_fields)
            self.check_request(chat)
            return len(await self.engine.run_off_loop(self._chat_prompt, chat))

    def _chat_logprobs(self, token_ids: list[int], entries: list[dict[int, float]], top_k: int) -> dict[str, Any]:
        content = []
        for tok, entry in zip(token_ids, entries):
            text = self._token_text(tok)
            top = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:top_k]
            content.append(
                {
                    "token": text,
                    "logprob": entry[tok],
                    "bytes": self._token_bytes(tok, text),
                    "top_logprobs": [
                        {"token": (t_text := self._token_text(t)), "logprob": lp, "bytes": self._token_bytes(t, t_text)}
                        for t, lp in top
                    ],
                }
            )
        return {"content": content}

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        cid = response_id("chatcmpl", req, raw)
        run = await self.start_chat(req)
        created = int(time.time())
        if req.stream:
            return StreamingResponse(
                _guard_stream(self._stream_chat(run, req, cid, created)), media_type="text/event-stream"
            )
        (out,) = await self._collect([run.iterator], raw)
        choices = []
        for c in out.outputs:
            parser = run.new_parser()
            parser.update(c.text, final=True)
            message: dict[str, Any] = {"role": "assistant", "content": parser.content}
            if parser.reasoning_parser is not None:  # null when the reply has none, as vLLM answers
                message["reasoning_content"] = parser.reasoning or None
            if parser.tool_calls:
                message["content"] = parser.content if parser.content.strip() else None  # null beside calls (OpenAI)
                message["tool_calls"] = [
                    {"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
                    for t in parser.tool_calls
                ]
            choice: dict[str, Any] = {
                "index": c.index,
                "message": message,
                "logprobs": None,
                "finish_reason": _chat_finish_reason(c.finish_reason, parser),
            }
            if c.stop_reason is not None:
                choice["stop_reason"] = c.stop_reason
            if req.logprobs:
                choice["logprobs"] = self._chat_logprobs(c.token_ids, c.logprobs or [], req.top_logprobs or 0)
            choices.append(choice)
        return JSONResponse(
            {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": self.served_name(req.model),
                "choices": choices,
                "usage": _usage(len(run.prompt_ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens),
            }
        )

    async def _stream_chat(self, run: ChatRun, req: ChatCompletionRequest, cid: str, created: int):
        base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.served_name(req.model)}
        parsers: dict[int, ChatOutputParser] = {}
        content_chunks: dict[int, _TextChunk] = {}  # index -> its content-only chunk, serialized once
        sent_tokens: dict[int, int] = {}
        completion_tokens = cached_tokens = 0
        for i in range(req.n):
            yield _sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
        finished: set[int] = set()  # choices whose finish was sent (n > 1: later outputs repeat them)
        async for _, out in _merge([run.iterator]):
            cached_tokens = out.num_cached_tokens
            for c in out.outputs:
                if c.index in finished:
                    continue
                parser = parsers.setdefault(c.index, run.new_parser())
                start_tok = sent_tokens.get(c.index, 0)
                new_tokens = c.token_ids[start_tok:]
                delta = parser.update(c.text, final=c.finish_reason is not None)
                want_logprobs = req.logprobs and new_tokens
                if not delta and not want_logprobs and c.finish_reason is None:
                    continue
                chat_delta = _chat_delta(delta)
                if not want_logprobs and c.finish_reason is None and chat_delta.keys() == {"content"}:
                    sent_tokens[c.index] = len(c.token_ids)  # content only: most chunks of a stream
                    chunk = content_chunks.get(c.index)
                    if chunk is None:
                        chunk = content_chunks[c.index] = _TextChunk({**base, "choices": [
                            {"index": c.index, "logprobs": None, "finish_reason": None, "delta": {"content": ""}}]})
                    yield chunk(chat_delta["content"])
                    continue
                # OpenAI's schema requires logprobs and finish_reason on every choice (null unset)
                choice: dict[str, Any] = {"index": c.index, "delta": chat_delta, "logprobs": None, "finish_reason": None}
                if want_logprobs:
                    choice["logprobs"] = self._chat_logprobs(new_tokens, (c.logprobs or [])[start_tok:], req.top_logprobs or 0)
                if c.finish_reason is not None:
                    choice["finish_reason"] = _chat_finish_reason(c.finish_reason, parser)
                    if c.stop_reason is not None:
                        choice["stop_reason"] = c.stop_reason
                    completion_tokens += len(c.token_ids)
                    finished.add(c.index)
                sent_tokens[c.index] = len(c.token_ids)
                yield _sse({**base, "choices": [choice]})
        if req.stream_options is not None and req.stream_options.include_usage:
            yield _sse({**base, "choices": [], "usage": _usage(len(run.prompt_ids), completion_tokens, cached_tokens)})
        yield _sse("[DONE]")

    # ------------------------------------------------------------------ non-streaming
    async def _collect(self, iterators: list[AsyncIterator[RequestOutput]], raw: Request) -> list[RequestOutput]:
        """Final outputs of every iterator; aborts them all if the client disconnects.

        Raises:
            APIError: for a request the engine failed (400 / 500) or a stopped engine (503).
        """
        finals: list[RequestOutput | None] = [None] * len(iterators)

        async def consume() -> None:
            async for i, out in _merge(iterators):
                finals[i] = out

        task = asyncio.create_task(consume())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.2)
                if not task.done() and await raw.is_disconnected():
                    task.cancel()
                    raise APIError(499, "client disconnected", "ClientDisconnected")
            task.result()
        except (RequestFailedError, EngineDeadError) as exc:
            raise _as_api_error(exc) from None
        finally:
            if not task.done():
                task.cancel()
        return finals  # type: ignore[return-value]


