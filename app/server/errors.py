"""Engine errors, mapped once: to /ws error frames and to OpenAI error objects.

The engine raises types (app.engine.errors); this is the only place that decides what a
client is told for each. Anything else is our fault: logged where it happens, and the
client hears "internal".
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from app.engine.errors import BadParameter, ContextTooLong, EngineDead, Overloaded
from app.server import protocol as p


class APIError(Exception):
    """An OpenAI error object and its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


ENGINE_ERRORS = (BadParameter, Overloaded, EngineDead)  # what a caller should expect


def ws_error(exc: BaseException, turn_id: str | None) -> p.ProtocolError:
    """The /ws error frame for an engine error."""
    if isinstance(exc, ContextTooLong):
        return p.ProtocolError(p.TOO_LONG, str(exc), turn_id)
    if isinstance(exc, BadParameter):
        return p.ProtocolError(p.BAD_REQUEST, str(exc), turn_id)
    if isinstance(exc, Overloaded):
        return p.ProtocolError(p.BUSY, str(exc), turn_id, retryable=True)
    if isinstance(exc, EngineDead):
        return p.ProtocolError(p.UNAVAILABLE, str(exc), turn_id, retryable=True)
    return p.ProtocolError(p.INTERNAL, "internal error", turn_id, retryable=True)


def api_error(exc: BaseException, prompt_param: str = "messages") -> APIError:
    """The OpenAI error object for an engine error. `prompt_param` names the field that
    held the prompt (a context too long is its fault)."""
    if isinstance(exc, ContextTooLong):
        return APIError(400, str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, BadParameter):
        return APIError(400, str(exc), param=exc.name)
    if isinstance(exc, Overloaded):
        retry = str(max(1, round(exc.retry_after_s)))
        return APIError(
            429, str(exc), "rate_limit_error", code="server_busy", headers={"Retry-After": retry}
        )
    if isinstance(exc, EngineDead):
        return APIError(503, str(exc), "server_error", code="engine_unavailable")
    return APIError(500, "internal error", "server_error")
