"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

log = logging.getLogger(__name__)
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    410: "not_found_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


def internal(exc: BaseException, what: str = "the request") -> APIError:
    """A 500 for a failure of ours: the details go to the log, never to the client."""
    log.error("%s failed", what, exc_info=exc)
    return APIError(500, f"{what} failed inside the server; the daemon's log has the details", code="internal_error")


async def internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    return internal(exc, f"{request.method} {request.url.path}").response()
