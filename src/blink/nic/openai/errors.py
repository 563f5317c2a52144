"""The OpenAI-style error every refusal leaves the HTTP server as: ``{"error": {"message", "type", "param",
"code"}}``, whose message says what was wrong and what to do; and the HTTP form of the agent loop's refusals."""
from __future__ import annotations

from aiohttp import web

from blink.errors import EngineUnavailable, Overloaded, RequestError

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable_error"}


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body; ``message`` says what was wrong and what to do."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = {"Retry-After": str(retry_after_s)} if retry_after_s else None

    def body(self) -> dict:
        kind = _ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


REFUSALS = (ApiError, EngineUnavailable, Overloaded, RequestError)


def api_error(error: Exception) -> ApiError:
    """The HTTP form of a refusal: 503 for an unavailable engine, 429 for a full server, 400 for a request field."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, EngineUnavailable):
        return ApiError(503, str(error), retry_after_s=error.retry_after_s)
    if isinstance(error, Overloaded):
        return ApiError(429, str(error), retry_after_s=error.retry_after_s)
    if isinstance(error, RequestError):
        return ApiError(400, str(error), param=error.field)
    raise TypeError(f"no HTTP form for {error!r}")
