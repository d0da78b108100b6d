"""Tool calling in chat requests: the request types (``tools``, ``tool_choice``, tool calls in
messages) and the JSON schema that enforces ``tool_choice: "required"`` or a named function.

Semantics follow the OpenAI chat completions API and vLLM:

- ``tool_choice`` ``"auto"`` (the default with tools): the model decides; the server's tool
  parser (``--tool-call-parser``, else the family detected from the chat template, else
  ``generic``) reads its calls out of the text. Once the model starts a call (the parser's
  trigger: ``<tool_call>``, ``{"name"``), the rest of the call is constrained to one of the
  tools with arguments valid for its schema (``tool_call_structural_tag``, vLLM's / SGLang's
  structural tags, enforced by llguidance), so a call that starts always parses.
- ``"none"``: the tools are still rendered in the prompt (as vLLM does by default), the
  output is never read as calls.
- ``"required"`` / ``{"type": "function", "function": {"name": ...}}``: the output is
  constrained by guided decoding (``kvflow.sample.guided``, llguidance) to a JSON array of
  ``{"name", "parameters"}`` objects (one of the tools each; at most one unless
  ``parallel_tool_calls``) / to that function's arguments object, so the arguments are
  valid JSON for the tool's parameter schema by construction. No parser is needed.

``parallel_tool_calls: false`` keeps the first call of an ``"auto"`` reply.
"""

from __future__ import annotations

import json
from typing import Any

# protocol.py calls check_tools from its validator: this module never imports it back (not
# even for types); its ChatTool / ToolChoice models are duck-typed here.
ChatTool = ToolChoice = Any

# llguidance's JSON options (its "x-guidance" schema key): one fixed layout, no free
# whitespace (a model, random weights included, cannot pad forever), unknown schema
# keywords ignored (tool schemas carry titles, formats, examples...).
_GUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def check_tools(tools: list[ChatTool] | None, tool_choice: ToolChoice | None) -> None:
    """Raises ValueError naming the field: a tool whose ``parameters`` schema is not of type
    ``object`` (a call's arguments are a JSON object: under ``"required"`` or a named function
    the constrained output could never be read as a call, and came back as content), duplicate
    tool names, a ``tool_choice`` that needs tools without any, a named function that is not
    among them."""
    for i, tool in enumerate(tools or []):
        kind = (tool.function.parameters or {}).get("type", "object")
        if kind != "object":
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema of type 'object' (a function's "
                             f"arguments are a JSON object), got type {kind!r}")
    names = [t.function.name for t in tools or []]
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"tools has two functions named {name!r}")
        seen.add(name)
    if tool_choice in (None, "none", "auto"):
        return
    if not names:
        raise ValueError(f"tool_choice {_choice_text(tool_choice)} needs tools")
    if not isinstance(tool_choice, str) and tool_choice.function.name not in seen:  # a named function
        raise ValueError(f"tool_choice names the function {tool_choice.function.name!r}, which is not in tools")


def tool_schema_error(tools: list[ChatTool] | None) -> str | None:
    """The first tool whose ``parameters`` the grammar engine refuses as a JSON schema,
    described, or None. For a request whose calls are not constrained (its own
    ``response_format``, ``tool_choice: "none"``, a parser without call forms): a schema
    the calls' constraint would compile is checked when that is built."""
    from kvflow.sample.guided import json_schema_error

    for i, tool in enumerate(tools or []):
        error = json_schema_error({**_parameters(tool), "x-guidance": _GUIDANCE})
        if error is not None:
            return f"tools[{i}].function.parameters is not a usable JSON schema: {error}"
    return None


def _choice_text(tool_choice: ToolChoice) -> str:
    return repr(tool_choice) if isinstance(tool_choice, str) else f"{{'function': {{'name': {tool_choice.function.name!r}}}}}"


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters else _NO_PARAMETERS


#: Keywords whose values are data, not schemas: a "$ref" key inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example"})


def _rebase_refs(schema: Any, pointer: str) -> Any:
    """``schema`` (a tool's parameters) as it reads placed at JSON pointer ``pointer`` of a
    larger schema: each local reference (``"$ref": "#/$defs/City"``, what Pydantic's
    ``model_json_schema`` writes for a nested model; ``"#"`` itself) is rewritten to start
    there (``"#<pointer>/$defs/City"``), so that it still names the tool's own definitions.
    References to other documents are left as they are."""
    if isinstance(schema, list):
        return [_rebase_refs(item, pointer) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = "#" + pointer + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rebase_refs(value, pointer)
    return out


def tool_choice_schema(tools: list[ChatTool], tool_choice: ToolChoice, parallel_tool_calls: bool) -> dict[str, Any] | None:
    """The JSON schema the output is constrained to, for ``"required"`` or a named function
    (None for ``"auto"`` / ``"none"``).

    ``"required"``: ``[{"name": <one of the tools>, "parameters": <its arguments>}, ...]``,
    at least one item, at most one unless ``parallel_tool_calls`` (vLLM's schema, with the
    wrapper objects closed; each tool's local ``$ref`` rebased to where its parameters sit:
    ``_rebase_refs``). A named function: its parameter schema.
    """
    if not isinstance(tool_choice, str):  # a named function (NamedToolChoice)
        (tool,) = [t for t in tools if t.function.name == tool_choice.function.name]
        return {**_parameters(tool), "x-guidance": _GUIDANCE}
    if tool_choice != "required":
        return None
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "parameters": _rebase_refs(_parameters(t), "/items" + ("" if len(tools) == 1 else f"/anyOf/{i}")
                                           + "/properties/parameters"),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for i, t in enumerate(tools)
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    schema["x-guidance"] = _GUIDANCE
    return schema


def tool_call_structural_tag(tools: list[ChatTool], forms: tuple[tuple[str, str, str, str], ...]) -> dict[str, Any] | None:
    """The structural tag (``SamplingParams.structural_tag``, vLLM's shape) that constrains
    each call the model starts under ``tool_choice: "auto"``: per form of the parser
    (``ToolParser.call_forms``: trigger, text before the name, text between the name and
    the arguments, text after them) and per tool, a structure ``begin`` = the text before,
    the name (a JSON string), the text between; ``schema`` = the tool's parameters; ``end``.
    None for a parser without forms.
    """
    if not forms or not tools:
        return None
    structures = [
        {
            "begin": f"{head}{json.dumps(t.function.name)}{between}",
            "schema": {**_parameters(t), "x-guidance": _GUIDANCE},
            "end": end,
        }
        for _, head, between, end in forms
        for t in tools
    ]  # fmt: skip
    return {"type": "structural_tag", "structures": structures, "triggers": [trigger for trigger, *_ in forms]}


def template_tools(tools: list[ChatTool]) -> list[dict[str, Any]]:
    """The tools as ``apply_chat_template(tools=...)`` takes them (OpenAI's JSON shape)."""
    return [t.model_dump(exclude_none=True) for t in tools]
