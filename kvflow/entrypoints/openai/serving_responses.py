"""``POST /v1/responses``: OpenAI's Responses API, stateless.

A request is turned into the chat request it means (``to_chat_fields``) and runs as one
(``OpenAIServing.start_translated_chat``: the chat template, tools, forced tool calls by guided
decoding, the tool and reasoning parsers); its output is rendered as Responses output items
(``reasoning``, ``message`` with ``output_text``, ``function_call``), whole or as the
Responses streaming events (``response.created``, ``response.output_item.added``,
``response.output_text.delta``, ``response.function_call_arguments.delta``, ...,
``response.completed``), following the OpenAI API reference.

Input: a non-empty string (one user message), or a non-empty list of items: messages
(``{"role", "content"}`` with ``input_text`` / ``output_text`` parts or a string; a user,
system or developer message's text must not be empty), ``function_call`` (an earlier call of
the model: an assistant message with tool calls) and ``function_call_output`` (its result:
a tool message). ``instructions`` becomes the system message.

Refused by name: what needs server-side state (``previous_response_id``, ``conversation``,
``store: true``, ``background``), built-in tools (web search, file search, ...), image /
file / audio input parts, and the other fields listed in ``ResponsesRequest.UNSUPPORTED``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import field_validator
from kvflow.entrypoints.openai.chat_output import ChatOutputParser, ChatRun, OutputSequencer
from kvflow.entrypoints.openai.protocol import Metadata, _Body, _short, check_tool_count

if TYPE_CHECKING:
    from kvflow.entrypoints.openai.serving import OpenAIServing

# chat request field -> the Responses field an error about it names
RENAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "guided_json": "text",
           "response_format": "text"}  # fmt: skip


class ResponsesRequest(_Body):
    """POST /v1/responses (the fields kvflow reads; ``UNSUPPORTED`` ones are refused)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    metadata: Metadata | None = None
    # fields that do not change the output
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    # fields kvflow does not implement
    store: bool | None = None
    previous_response_id: Any = None
    conversation: Any = None
    background: bool | None = None
    include: list[Any] | None = None
    reasoning: Any = None
    prompt: Any = None
    top_logprobs: int | None = None
    truncation: str | None = None
    max_tool_calls: int | None = None
    stream_options: Any = None
    context_management: Any = None  # compaction of a long context: changes the prompt
    moderation: Any = None  # moderating (blocking) the input and output

    _tools_bounded = field_validator("tools", mode="before")(check_tool_count)

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "store": (False,), "previous_response_id": (), "conversation": (), "background": (False,), "include": ([],),
        "reasoning": (), "prompt": (), "top_logprobs": (0,), "truncation": ("disabled",), "max_tool_calls": (),
        "stream_options": (), "context_management": ([],), "moderation": (),
    }  # fmt: skip

    def unsupported_field(self) -> tuple[str, str] | None:
        found = super().unsupported_field()
        if found is not None and found[0] in ("store", "previous_response_id", "conversation", "background"):
            return found[0], f"{found[1]} (kvflow's server is stateless: it keeps no responses)"
        if found is None and isinstance(self.text, dict) and self.text.get("verbosity") is not None:
            # (only text.format is read; Chat Completions refuses its verbosity alike)
            return "text", (f"text.verbosity is not supported by kvflow (set to {_short(self.text['verbosity'])}); "
                            "leave it unset")
        return found


def _text_parts(content: Any, where: str, allowed: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise ValueError(
                f"{where}[{j}]: content parts of type {kind!r} are not supported by kvflow "
                f"({' / '.join(allowed)} only: the served models read text)"
            )
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}].text must be a string")
        texts.append(part["text"])
    return "\n".join(texts)  # (one per line, as chat's text_content)


def _unanswered(unanswered: dict[str, int], why: str) -> ValueError:
    """The 400 naming the first function_call item (``unanswered``: call_id -> input index)
    that no function_call_output answers, ``why`` ending its message."""
    call_id, at = next(iter(unanswered.items()))
    return ValueError(f"input[{at}]: no function_call_output item answers this function_call (call_id "
                      f"{_short(call_id)}){why}")


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of ``instructions`` and ``input``.

    Raises:
        ValueError: naming the item, for an item or part kvflow does not read, an empty
            ``input``, a user, system or developer message without text, or a
            ``function_call_output`` whose ``call_id`` is that of no earlier
            ``function_call`` item (as OpenAI refuses it), or a ``function_call`` item
            whose output does not come before the next message item (an assistant message
            right after the turn's calls is that turn's text: it joins their message).
    """
    messages: list[dict[str, Any]] = []
    call_ids: set[str] = set()  # those of the function_call items so far
    unanswered: dict[str, int] = {}  # call_id -> index of a function_call item no output has answered yet
    follows_calls = False  # the items since the last message item: function_call items (and their outputs)
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if not req.input:  # (an empty user turn: nothing for the model to answer)
        got = "an empty string" if isinstance(req.input, str) else "an empty list"
        raise ValueError(f"input must be a non-empty string or a non-empty list of input items, got {got}")
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ValueError(f"{where}.role must be user, system, developer or assistant, got {role!r}")
            allowed = ("output_text", "input_text") if role == "assistant" else ("input_text",)
            text = _text_parts(item.get("content"), f"{where}.content", allowed)
            if not text and role != "assistant":  # (an assistant turn of earlier output may be empty)
                raise ValueError(f"{where}.content must not be empty (a {role} message needs text)")
            last = messages[-1] if messages else None
            if unanswered and role == "assistant" and last is not None and last.get("tool_calls"):
                # text the model wrote after its calls (a streamed turn's items: function_call,
                # then message): the same turn, one assistant message with the calls, as above
                last["content"] = "\n".join(t for t in (last["content"], text) if t) or None
                continue
            if unanswered:  # (the chat request's tool messages follow the calls' assistant message)
                raise _unanswered(unanswered, f" before the next message item, {where}: each call's output comes after "
                                              "the call and before the next message")
            messages.append({"role": role, "content": text})
            follows_calls = False
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise ValueError(f"{where}.{key} must be a string (a function_call item)")
            if unanswered and messages[-1]["role"] == "tool":  # a new turn of calls, the last one's not all answered
                raise _unanswered(unanswered, f" before the next turn's function_call item, {where}")
            try:  # (else chat's 400 named its own message: "input.1.tool_calls.0.function.arguments")
                json.loads(item["arguments"])
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}.arguments is not valid JSON: {exc}") from None
            except RecursionError:
                raise ValueError(f"{where}.arguments is nested too deeply") from None
            call_ids.add(item["call_id"])
            unanswered[item["call_id"]] = i
            follows_calls = True
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                # the turn's text and all its (parallel) calls are one assistant message, as
                # the Chat Completions API has them: a call after a message item with text
                # started a second assistant turn, and the model, seeing two turns with one
                # call each before the results, answered the next turn with nothing
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ValueError(f"{where}.call_id must be a string (a function_call_output item)")
            if item["call_id"] not in call_ids:
                raise ValueError(f"{where}.call_id: no function_call item before it has call_id "
                                 f"{_short(item['call_id'])} (a function_call_output answers an earlier call)")
            if not follows_calls:  # (chat's tool message follows its call's assistant message)
                raise ValueError(f"{where}: a function_call_output item must follow the function_call items of its "
                                 "turn (or their other outputs); it follows a message item")
            unanswered.pop(item["call_id"], None)
            output = item.get("output")
            if not isinstance(output, str):
                output = _text_parts(output, f"{where}.output", ("input_text",))
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif kind == "reasoning":
            continue  # earlier reasoning: chat templates of thinking models leave it out of the prompt
        else:
            raise ValueError(f"{where}.type {kind!r} is not supported by kvflow (message, function_call, "
                             "function_call_output and reasoning items only)")
    if unanswered and messages[-1]["role"] == "tool":  # some of the last turn's calls answered, not all
        raise _unanswered(unanswered, "; the outputs of its turn answer the others")
    return messages


def _tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    if req.tools is None:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        if tool.get("type") != "function":
            raise ValueError(f"tools[{i}].type {tool.get('type')!r} is not supported by kvflow (function tools only: "
                             "no built-in tools on this server)")
        if not isinstance(tool.get("name"), str):  # (else chat's 400 named "tools.0.function.name")
            raise ValueError(f"tools[{i}].name must be a string (a function tool's name)")
        if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
            raise ValueError(f"tools[{i}].parameters must be an object (a JSON schema)")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):  # (else chat's 400 listed its string choices)
            raise ValueError("tool_choice.name must be a string (the function's name) for tool_choice of type "
                             "'function'")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValueError(f"tool_choice of type {choice.get('type')!r} is not supported by kvflow (none, auto, required "
                     "or a function)")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ValueError("text.format must be an object ({\"type\": \"text\" | \"json_object\" | \"json_schema\", ...})")
    if fmt.get("type") == "json_schema":
        if fmt.get("schema") is None:  # (else chat's message would name response_format.json_schema.schema)
            raise ValueError("text.format.schema is required for type json_schema")
        spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": fmt.get("type")}


def to_chat_fields(req: ResponsesRequest) -> dict[str, Any]:
    """The chat completions request ``req`` means.

    Raises:
        ValueError: naming the field, for an input item, part, tool or tool_choice kvflow
            does not read.
    """
    response_format = _response_format(req.text)
    forced = req.tools and req.tool_choice not in (None, "none", "auto")
    if forced and response_format is not None and response_format.get("type") != "text":
        # (chat's message named its own response_format)
        raise ValueError(f"tool_choice (a forced tool call) cannot be combined with text.format of type "
                         f"{response_format['type']!r}")
    fields: dict[str, Any] = {
        "model": req.model, "messages": _messages(req), "tools": _tools(req), "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls, "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "response_format": response_format,
    }  # fmt: skip
    return {k: v for k, v in fields.items() if v is not None}


def _usage(prompt_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int = 0) -> dict[str, Any]:
    """``cached_tokens``: prompt tokens that were prefix-cache hits (``RequestOutput.num_cached_tokens``);
    ``reasoning_tokens``: ``reasoning_token_count``'s."""
    return {
        "input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }  # fmt: skip


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Response:
    """The response object's fields, shared by the final object and the streamed events."""

    def __init__(self, req: ResponsesRequest, model_name: str) -> None:
        self.req = req
        self.base = {
            "id": _new_id("resp"), "object": "response", "created_at": int(time.time()), "model": model_name,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
            "store": False, "temperature": req.temperature, "top_p": req.top_p,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
            "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled", "metadata": req.metadata or {},
            "reasoning": None, "error": None, "user": req.user,
        }  # fmt: skip

    def object(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
               finish_reason: str | None = None) -> dict[str, Any]:
        incomplete = finish_reason == "length"
        return {
            **self.base, "status": "incomplete" if incomplete else status, "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "usage": usage,
        }  # fmt: skip


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status != "in_progress" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}  # fmt: skip


def reasoning_token_count(tokenizer: Any, reasoning: str, output_tokens: int) -> int:
    """The output tokens a choice spent reasoning: its reasoning text (the reasoning parser's,
    without the ``<think>`` markers) encoded again, at most ``output_tokens`` (the parser splits
    text, not token ids, so this is the text's token count, which a model's own tokens of it
    match unless it wrote an unusual split of the same text)."""
    if not reasoning:
        return 0
    return min(output_tokens, len(tokenizer.encode(reasoning, add_special_tokens=False)))


def output_items(parser: ChatOutputParser, finish_reason: str | None = None) -> list[dict[str, Any]]:
    """The output items of a finished choice: reasoning, the message, the function calls; the
    last one ``incomplete`` when ``max_output_tokens`` cut it (as OpenAI marks it), unless it is
    a function call (only a whole call is one)."""
    items = []
    if parser.reasoning:
        items.append(_reasoning_item(_new_id("rs"), parser.reasoning))
    if parser.content and not (parser.tool_calls and not parser.content.strip()):
        items.append(_message_item(_new_id("msg"), parser.content))
    for call in parser.tool_calls:
        items.append(_call_item(_new_id("fc"), call.id, call.name, call.arguments))
    if items and finish_reason == "length" and items[-1]["type"] != "function_call":  # (a call is sent whole)
        items[-1]["status"] = "incomplete"
    return items


async def create_response(serving: OpenAIServing, req: ResponsesRequest, raw: Request) -> Response:
    """Handle POST /v1/responses.

    Raises:
        APIError: 400 naming the field (unsupported fields, items, parts, tools), and the
            errors of ``OpenAIServing.start_chat``.
    """
    run = await serving.start_translated_chat(req, to_chat_fields, RENAMES)
    response = _Response(req, serving.served_name(req.model))
    if req.stream:
        return StreamingResponse(_stream(run, response, serving.tokenizer), media_type="text/event-stream")
    (out,) = await serving._collect([run.iterator], raw)
    (choice,) = out.outputs
    parser = run.new_parser()
    parser.update(choice.text, final=True)
    usage = _usage(len(run.prompt_ids), len(choice.token_ids), out.num_cached_tokens,
                   reasoning_token_count(serving.tokenizer, parser.reasoning, len(choice.token_ids)))
    return JSONResponse(response.object("completed", output_items(parser, choice.finish_reason), usage,
                                        choice.finish_reason))


def _event(kind: str, seq: list[int], **fields: Any) -> str:
    seq[0] += 1
    payload = {"type": kind, "sequence_number": seq[0] - 1, **fields}
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _stream(run: ChatRun, response: _Response, tokenizer: Any):
    """The Responses streaming events of one run; a fault after the start is an ``error``
    event (OpenAI's shape: ``code``, ``message``, ``param``)."""
    from kvflow.entrypoints.openai.serving import _as_api_error, _merge

    seq = [0]
    yield _event("response.created", seq, response=response.object("in_progress", []))
    yield _event("response.in_progress", seq, response=response.object("in_progress", []))
    parser = run.new_parser()
    sequencer = OutputSequencer()
    items: list[dict[str, Any]] = []  # finished items
    open_item: dict[str, Any] = {}
    text = ""

    def start(ev) -> list[str]:
        nonlocal open_item, text
        text = ""
        index = len(items)
        if ev.part == "tool_call":
            open_item = _call_item(_new_id("fc"), ev.call.id, ev.call.name, "", "in_progress")
            return [_event("response.output_item.added", seq, output_index=index, item=open_item)]
        if ev.part == "reasoning":
            open_item = _reasoning_item(_new_id("rs"), "", "in_progress")
            return [_event("response.output_item.added", seq, output_index=index, item=open_item)]
        open_item = _message_item(_new_id("msg"), "", "in_progress")
        part = {"type": "output_text", "text": "", "annotations": []}
        return [_event("response.output_item.added", seq, output_index=index, item=open_item),
                _event("response.content_part.added", seq, item_id=open_item["id"], output_index=index,
                       content_index=0, part=part)]  # fmt: skip

    def delta(ev) -> str:
        nonlocal text
        text += ev.text
        ids = {"item_id": open_item["id"], "output_index": len(items)}
        if ev.part == "tool_call":
            return _event("response.function_call_arguments.delta", seq, **ids, delta=ev.text)
        if ev.part == "reasoning":
            return _event("response.reasoning_text.delta", seq, **ids, content_index=0, delta=ev.text)
        return _event("response.output_text.delta", seq, **ids, content_index=0, delta=ev.text, logprobs=[])

    def stop(ev, status: str = "completed") -> list[str]:
        ids = {"item_id": open_item["id"], "output_index": len(items)}
        if ev.part == "tool_call":
            item = {**open_item, "arguments": text, "status": status}
            events = [_event("response.function_call_arguments.done", seq, **ids, name=item["name"], arguments=text)]
        elif ev.part == "reasoning":
            item = _reasoning_item(open_item["id"], text, status)
            events = [_event("response.reasoning_text.done", seq, **ids, content_index=0, text=text)]
        else:
            item = _message_item(open_item["id"], text, status)
            events = [_event("response.output_text.done", seq, **ids, content_index=0, text=text, logprobs=[]),
                      _event("response.content_part.done", seq, **ids, content_index=0, part=item["content"][0])]
        events.append(_event("response.output_item.done", seq, output_index=len(items), item=item))
        items.append(item)
        return events

    handlers = {"start": start, "delta": lambda ev: [delta(ev)], "stop": stop}
    try:
        async for _, out in _merge([run.iterator]):
            (c,) = out.outputs
            events = sequencer.feed(parser.update(c.text, final=c.finish_reason is not None))
            if c.finish_reason is not None:
                events += sequencer.close()
            # the item max_output_tokens cut (the last one stopped) is incomplete, as in output_items
            cut = max((i for i, ev in enumerate(events) if ev.kind == "stop"), default=None) \
                if c.finish_reason == "length" else None
            if cut is not None and events[cut].part == "tool_call":
                cut = None
            for i, ev in enumerate(events):
                for line in stop(ev, "incomplete") if i == cut else handlers[ev.kind](ev):
                    yield line
            if c.finish_reason is not None:
                usage = _usage(len(run.prompt_ids), len(c.token_ids), out.num_cached_tokens,
                               reasoning_token_count(tokenizer, parser.reasoning, len(c.token_ids)))
                final = response.object("completed", items, usage, c.finish_reason)
                yield _event(f"response.{final['status']}", seq, response=final)
    except Exception as exc:  # noqa: BLE001 - reported to the client in the stream
        error = _as_api_error(exc)
        yield _event("error", seq, code=str(error.status), message=error.message, param=error.param)
