"""Every error the server answers, in OpenAI's shape: {"error": {message, type, param, code}}."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class Refused(Exception):
    """A request the server answers with a 4xx: status, message, error type, parameter."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_response(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def add_error_handlers(app: FastAPI) -> None:
    """Bodies that fail validation, FastAPI's own HTTP errors and `Refused` all answer in OpenAI's shape."""

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: HttpRequest, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        if first.get("type") == "json_invalid":  # loc holds the character where parsing stopped, not a field
            where = first.get("loc", (None, "?"))[-1]
            reason = first.get("ctx", {}).get("error", first.get("msg"))
            return error_response(400, f"the request body is not valid JSON (character {where}: {reason})",
                                  "invalid_request_error")
        if isinstance(first.get("input"), bytes) and "json" not in request.headers.get("content-type", ""):
            return error_response(400, "the request body must be JSON sent with Content-Type: application/json",
                                  "invalid_request_error")
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(400, f"{where or 'body'}: {first.get('msg')}", "invalid_request_error", where or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: HttpRequest, error: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if error.status_code < 500 else "internal_error"
        return error_response(error.status_code, str(error.detail), kind)

    @app.exception_handler(Refused)
    async def refused(_: HttpRequest, error: Refused) -> JSONResponse:
        return error_response(error.status, error.message, error.kind, error.param)
