"""OpenAI-shaped errors of the server: ``{"error": {"message", "type", "param", "code"}}``.

Apart from ``server.py`` so that the modules serving other routes (``kvflow.entrypoints.web``)
raise the same errors without importing the server (which imports them).
"""

from __future__ import annotations

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
