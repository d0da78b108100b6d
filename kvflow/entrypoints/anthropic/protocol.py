"""Request bodies of the Anthropic Messages API (``POST /v1/messages``), and the chat request
each one means.

Field names follow Anthropic's API reference. Validation is that of the OpenAI bodies
(``kvflow.entrypoints.openai.protocol._Body``: strict types, finite numbers, unknown fields
logged once); fields kvflow does not implement are refused by name (``UNSUPPORTED``).

The mapping to a chat request (``to_chat_fields``): ``system`` is the system message; a
user message's ``text`` blocks are its content and each ``tool_result`` block a tool message
(``tool_call_id`` = ``tool_use_id``, which must be the id of a ``tool_use`` block of the
previous message, as Anthropic requires, and come before any ``text`` block of the message,
likewise; an ``is_error`` result's text is prefixed ``Error: ``);
an assistant message's ``text`` blocks are its content and its ``tool_use`` blocks its tool
calls; ``thinking`` blocks of earlier turns are not rendered (the chat templates of thinking
models leave earlier reasoning out of the prompt). A last assistant message (Anthropic's
prefill, which the reply continues) is refused (an empty one, which Anthropic allows, is
no prefill and is dropped), and so, as by Anthropic, are a message with
empty content and an empty ``text`` block (in ``messages``, ``system`` or a ``tool_result``).
``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` are chat's ``auto`` / ``required`` /
a named function / ``none``, and ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``; ``output_config.format``
(a JSON schema; ``output_format``, its name in the structured-outputs beta, too) is the chat ``response_format``,
enforced by guided decoding.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from kvflow.entrypoints.openai.protocol import _Body, check_tool_count


class AnthropicTool(_Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom" (a client tool); Anthropic's server tools have other types
    cache_control: Any = None  # prompt caching hints: no effect on the output

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"server tools (type {kind!r}) are not supported by kvflow: only client tools "
                             "(a name and an input_schema)")
        return data

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        """A schema of type ``object`` (Anthropic's rule: a tool's input is an object; a
        forced call of another type could never be read as a ``tool_use``)."""
        if schema.get("type", "object") != "object":
            raise ValueError(f"input_schema must be a JSON schema of type 'object', got type {schema['type']!r}")
        return schema


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]  # non-empty: checked by ``to_chat_fields`` (it knows the last message)


class MessagesRequest(_Body):
    """POST /v1/messages."""

    model: str
    max_tokens: int
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)  # Anthropic's range
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    output_config: dict[str, Any] | None = None  # its "format" (a JSON schema) is read; "effort" is refused
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's name of output_config.format
    _tools_bounded = field_validator("tools", mode="before")(check_tool_count)
    # fields that do not change the output
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: Any = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    diagnostics: Any = None
    # fields kvflow does not implement
    thinking: dict[str, Any] | None = None
    container: Any = None
    mcp_servers: list[Any] | None = None
    context_management: Any = None  # the context-management beta's edits (clearing old tool results ...)
    compaction: Any = None  # a beta compaction request: the reply is a summary of the conversation
    thread: Any = None  # a beta server-held conversation (kvflow keeps none)

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "thinking": ({"type": "disabled"},), "container": (), "mcp_servers": ([],),
        "context_management": ({}, {"edits": []}), "compaction": (), "thread": (),
    }  # fmt: skip

    def unsupported_field(self) -> tuple[str, str] | None:
        found = super().unsupported_field()
        if found is None and (self.output_config or {}).get("effort") is not None:
            return "output_config", "output_config.effort is not supported by kvflow; leave it unset"
        return found


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages request's prompt part (``max_tokens`` is
    not needed; the sampling fields, if sent, change nothing)."""

    max_tokens: int | None = None


def _response_format(req: MessagesRequest) -> dict[str, Any] | None:
    fmt, name = (req.output_config or {}).get("format"), "output_config.format"
    if req.output_format is not None:  # the beta's name of the same format (Anthropic still takes it)
        if fmt is not None:
            raise ValueError("output_format and output_config.format are both set: send one (output_format is "
                             "the structured-outputs beta's name of output_config.format)")
        fmt, name = req.output_format, "output_format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ValueError(f"{name} must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


_UNREAD_BLOCK = "content blocks of type {kind!r} are not supported by kvflow ({allowed} only: the served models read text)"


def _text(block: dict[str, Any], where: str) -> str:
    """The text of a ``text`` block: a non-empty string (Anthropic's rule and message)."""
    if not isinstance(block.get("text"), str):
        raise ValueError(f"{where}.text must be a string")
    if not block["text"]:
        raise ValueError(f"{where}: text content blocks must be non-empty")
    return block["text"]


def _system(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    texts = []
    for j, block in enumerate(system):
        if block.get("type") != "text":
            raise ValueError(f"system[{j}]: " + _UNREAD_BLOCK.format(kind=block.get("type"), allowed="text"))
        texts.append(_text(block, f"system[{j}]"))
    return [{"role": "system", "content": "\n\n".join(texts)}]


def _tool_result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content", "")
    if isinstance(content, list):
        parts = []
        for k, inner in enumerate(content):
            kind = inner.get("type") if isinstance(inner, dict) else None
            if kind != "text":
                raise ValueError(f"{where}.content[{k}]: " + _UNREAD_BLOCK.format(kind=kind, allowed="text"))
            parts.append(_text(inner, f"{where}.content[{k}]"))
        content = "\n".join(parts)
    elif not isinstance(content, str):
        raise ValueError(f"{where}.content must be a string or a list of text blocks")
    return f"Error: {content}" if block.get("is_error") else content


def _messages(req: MessagesRequest) -> list[dict[str, Any]]:
    """The chat messages of ``system`` and ``messages``.

    Raises:
        ValueError: naming the block, for a block kvflow does not read, an empty ``text``
            block, a message with empty content, a ``tool_result`` after a ``text`` block, a
            ``tool_result`` whose ``tool_use_id``
            is not the id of a ``tool_use`` block of the previous message, or a ``tool_use``
            that the next message does not answer with a ``tool_result`` (Anthropic's 400s).
    """
    messages = req.messages
    if len(messages) > 1 and messages[-1].role == "assistant" and not messages[-1].content:
        messages = messages[:-1]  # an empty final assistant message (Anthropic allows it): no prefill
    if messages[-1].role == "assistant":
        raise ValueError(f"messages[{len(messages) - 1}]: a final assistant message (a prefill the reply "
                         "continues) is not supported by kvflow; end with a user message")
    out = _system(req.system)
    tool_use_ids: set[str] = set()  # those of the previous message (a tool_result answers one of them)
    for i, message in enumerate(messages):
        previous_ids, tool_use_ids = tool_use_ids, set()
        if not message.content:  # "" or [] (the final assistant message, refused above, may be empty)
            raise ValueError(f"messages[{i}]: all messages must have non-empty content except for the optional "
                             "final assistant message")
        if isinstance(message.content, str):
            _check_answered(i, previous_ids, set())
            out.append({"role": message.role, "content": message.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        allowed = "text, tool_use, thinking" if message.role == "assistant" else "text, tool_result"
        for j, block in enumerate(message.content):
            where, kind = f"messages[{i}].content[{j}]", block.get("type")
            if kind == "text":
                texts.append(_text(block, where))
            elif kind == "tool_result" and message.role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise ValueError(f"{where}.tool_use_id must be a string")
                if block["tool_use_id"] not in previous_ids:  # (Anthropic's rule and message)
                    raise ValueError(f"{where}: unexpected tool_use_id found in tool_result blocks: "
                                     f"{block['tool_use_id']!r}. Each tool_result block must have a corresponding "
                                     "tool_use block in the previous message.")
                if texts:  # (Anthropic's rule: the results answer the calls right away; text comes after)
                    raise ValueError(f"{where}: tool_result blocks must come first in the content of a user "
                                     "message, before any text block (text goes after all the tool results)")
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": _tool_result_text(block, where)})
            elif kind == "tool_use" and message.role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise ValueError(f"{where} needs a string id and name (a tool_use block)")
                if not isinstance(block.get("input"), dict):
                    raise ValueError(f"{where}.input must be an object")
                tool_use_ids.add(block["id"])
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})  # fmt: skip
            elif kind in ("thinking", "redacted_thinking") and message.role == "assistant":
                continue
            else:
                raise ValueError(f"{where}: " + _UNREAD_BLOCK.format(kind=kind, allowed=allowed))
        _check_answered(i, previous_ids, {b.get("tool_use_id") for b in message.content if b.get("type") == "tool_result"})
        if message.role == "assistant":
            out.append({"role": "assistant", "content": "\n".join(texts) or None, **({"tool_calls": calls} if calls else {})})
        elif texts or not any(m["role"] == "tool" for m in out[-1:]):
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _check_answered(i: int, tool_use_ids: set[str], answered: set[Any]) -> None:
    """Refuse message ``i`` when it leaves a ``tool_use`` of the previous message
    (``tool_use_ids``) without a ``tool_result`` (``answered``: the ids its results answer).

    Raises:
        ValueError: naming the message and the ids (Anthropic's rule and message).
    """
    unanswered = sorted(tool_use_ids - answered)
    if unanswered:
        raise ValueError(f"messages[{i}]: tool_use ids were found without tool_result blocks immediately after: "
                         f"{', '.join(unanswered)}. Each tool_use block must have a corresponding tool_result block "
                         "in the next message.")


def _tools(req: MessagesRequest) -> list[dict[str, Any]] | None:
    if req.tools is None:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        if tool.type not in (None, "custom"):
            raise ValueError(f"tools[{i}].type {tool.type!r} is not supported by kvflow (client tools only: no "
                             "server tools here)")
        function = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(choice: AnthropicToolChoice | None) -> Any:
    if choice is None:
        return None
    if choice.type == "tool":
        if choice.name is None:
            raise ValueError("tool_choice.name is required for tool_choice of type 'tool'")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def to_chat_fields(req: MessagesRequest) -> dict[str, Any]:
    """The chat completions request ``req`` means.

    Raises:
        ValueError: naming the field, for a block, tool or tool_choice kvflow does not read.
    """
    if req.tool_choice is not None and req.tool_choice.type in ("any", "tool") and not req.tools:
        # (Anthropic's own check; chat's message would name its "required")
        raise ValueError(f"tool_choice of type {req.tool_choice.type!r} needs tools: none were given")
    response_format = _response_format(req)
    if response_format is not None and req.tool_choice is not None and req.tool_choice.type in ("any", "tool"):
        # (chat's message named its own response_format)
        name = "output_format" if req.output_format is not None else "output_config.format"
        raise ValueError(f"tool_choice of type {req.tool_choice.type!r} (a forced tool call) cannot be combined with "
                         f"{name}")
    parallel = None
    if req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use:
        parallel = False
    fields: dict[str, Any] = {
        "model": req.model, "messages": _messages(req), "max_tokens": req.max_tokens, "stop": req.stop_sequences,
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "tools": _tools(req),
        "tool_choice": _tool_choice(req.tool_choice), "parallel_tool_calls": parallel,
        "response_format": response_format,
        # thinking turned off: templates that can (Qwen3's ``enable_thinking``) render no room for it
        "chat_template_kwargs": {"enable_thinking": False} if req.thinking == {"type": "disabled"} else None,
    }  # fmt: skip
    return {k: v for k, v in fields.items() if v is not None}
