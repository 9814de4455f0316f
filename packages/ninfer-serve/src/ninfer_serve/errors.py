"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} for every failure.

A client's mistake is a 4xx with a message that names the parameter; only a fault of the server
itself is a 5xx. FastAPI's own errors (validation, unknown route, wrong method) are rendered in the
same shape.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger("ninfer_serve")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(HTTPException):
    """An error answered to the client. It is an HTTPException so that FastAPI re-raises it as
    is even from inside body parsing (the request size limit raises it there)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(status_code=status, detail=message)
        self.message = message
        self.param = param
        self.code = code


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    error_type = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first validation error as one line, and the parameter it concerns."""
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None
    return (f"{param}: {message}" if param else message), param


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status_code, exc.message, exc.param, exc.code)

    async def on_http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error", exc_info=exc)
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}")

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected)
