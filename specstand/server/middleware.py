"""ASGI middleware around every route: the body-size bound, the API key, and the trap that turns an unexpected
exception into one logged 500."""

from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI
from starlette.exceptions import HTTPException

from specstand.server.errors import error_response

logger = logging.getLogger(__name__)


class BodyLimit:
    """A request body over `limit` bytes gets a 413 before anything parses it."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._too_large(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    # a body sent in chunks, without its length: FastAPI answers an HTTPException raised while it
                    # reads the body as it is (any other exception there becomes a 400)
                    raise HTTPException(413, self._over)
            return message

        await self.app(scope, counted, send)

    @property
    def _over(self) -> str:
        return f"request body over {self.limit} bytes"

    async def _too_large(self, scope, receive, send) -> None:
        response = error_response(413, self._over, "invalid_request_error")
        await response(scope, receive, send)


class FailureTrap:
    """An unexpected exception becomes a 500 in OpenAI's error shape (if the response has not started) and its
    traceback is logged once, with the request id the client got. Starlette's own handler for Exception would
    re-raise it for the server to log a second time."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as error:  # noqa: BLE001 - the request fails, the server goes on
            request_id = scope.get("state", {}).get("request_id", "-")
            logger.error("request %s failed: %s %s", request_id, scope.get("method"), scope["path"], exc_info=error)
            if not started:
                message = f"internal error (request {request_id}): {type(error).__name__}: {error}"
                await error_response(500, message, "internal_error")(scope, receive, send)


class ApiKeyCheck:
    """/v1/* and /reset_prefix_cache without `Authorization: Bearer <key>` get a 401 in OpenAI's error shape."""

    def __init__(self, app, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        guarded = scope.get("path", "").startswith("/v1/") or scope.get("path") == "/reset_prefix_cache"
        if scope["type"] != "http" or not guarded:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        message = "invalid API key" if given else "missing API key: send the header Authorization: Bearer <key>"
        response = error_response(401, message, "authentication_error")
        await response(scope, receive, send)


def add_middleware(app: FastAPI, max_body_bytes: int, api_key: str | None) -> None:
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyCheck, key=api_key)
    app.add_middleware(FailureTrap)  # outermost: it sees whatever the others let through
