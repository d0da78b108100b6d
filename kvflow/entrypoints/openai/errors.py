"""OpenAI-shaped errors of the server: ``{"error": {"message", "type", "param", "code"}}``.

Apart from ``server.py`` so that the modules serving other routes (``kvflow.entrypoints.web``)
raise the same errors without importing the server (which imports them).
"""

from __future__ import annotations

import re
from typing import Any

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_ERROR_TYPES = {
    400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError", 405: "MethodNotAllowed",
    413: "RequestTooLargeError", 415: "UnsupportedMediaTypeError", 429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError",
}  # fmt: skip


class APIError(StarletteHTTPException):
    """An error to return as an OpenAI-shaped body (an HTTPException, so that FastAPI lets
    it through from the body parsing)."""

    def __init__(self, status: int, message: str, err_type: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(status, message, headers)
        self.status, self.message, self.param = status, message, param
        self.err_type = err_type or _ERROR_TYPES.get(status, "BadRequestError")

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.err_type, self.param, self.headers)

    def body(self) -> dict[str, Any]:
        return _error_body(self.status, self.message, self.err_type, self.param)


def _error_body(status: int, message: str, err_type: str, param: str | None = None) -> dict[str, Any]:
    # A message may quote the client's input: escape what UTF-8 cannot encode (lone
    # surrogates), or the response itself would fail to encode.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if param is not None:
        param = param.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(status: int, message: str, err_type: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(_error_body(status, message, err_type, param), status_code=status, headers=headers)


# pydantic names the member of a union (or a validator around a type) that an error belongs to
# inside the error's location: "str", "list[int]", "function-after[_check(), NamedToolChoice]".
_TYPE_WORDS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "any", "bytes"})
_WRAPPED = re.compile(r"^(?:function-(?:after|before|wrap|plain)|nullable|default|json-or-python|lax-or-strict)\[(.*)\]$")


def _member_name(tag: str) -> str:
    """A union member's tag as a reader knows it: ``function-after[_f(), NamedToolChoice]`` ->
    ``NamedToolChoice``, ``nullable[list[str]]`` -> ``list[str]``; other tags unchanged."""
    match = _WRAPPED.match(tag)
    while match:
        tag = match.group(1).rsplit("(), ", 1)[-1].strip()
        match = _WRAPPED.match(tag)
    return tag


def _is_member_tag(item: object) -> bool:
    """Whether a location item is pydantic's name of a union member (a type), not a field."""
    return isinstance(item, str) and ("[" in item or item in _TYPE_WORDS or item[:1].isupper())


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A request body's validation errors (FastAPI's ``RequestValidationError.errors()``,
    pydantic's error dicts) as one message and the field they concern.

    Each error reads ``path: msg``, the path the fields and list indexes of its location
    (FastAPI's leading ``body`` dropped); where the error belongs to one type of a union
    field, that type follows the path as ``(as str)``, instead of standing in the path as
    pydantic writes it (``stop.list[str].0``).

    Returns:
        (message, param): param the first error's top-level field, None for a body that is
        not JSON (pydantic's ``json_invalid``: its location is an offset into the body, so the
        message says the body is not JSON, the decoder's reason and that offset) or without
        errors.
    """
    parts, param = [], None
    for i, error in enumerate(errors):
        if error.get("type") == "json_invalid":  # (its loc is a byte offset, not a field: "1: JSON decode error")
            where = error.get("loc", ())[-1:] or ("?",)
            reason = (error.get("ctx") or {}).get("error") or error.get("msg")
            parts.append(f"the request body is not valid JSON: {reason} (at character {where[0]})")
            continue
        loc = list(error.get("loc", ()))
        if loc and loc[0] == "body":
            loc = loc[1:]
        path, types = [], []
        for item in loc:
            if path and _is_member_tag(item):
                types.append(_member_name(item))
            else:
                path.append(str(item))
        text = ".".join(path) or "body"
        if types:
            text += f" (as {' > '.join(types)})"
        parts.append(f"{text}: {error.get('msg')}")
        if i == 0 and path and error.get("type") != "json_invalid":
            param = path[0]
    return "; ".join(parts) or "invalid request", param
