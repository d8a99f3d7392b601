"""413 for a request body over --max-request-body-bytes, before any of it is parsed, and 408 for
one that has not fully arrived --body-timeout after its head.

A declared Content-Length over the limit is refused before a byte of the body is read; a chunked
body is counted as it arrives and refused at the chunk that crosses the limit, so the server
never holds more than the limit of any one body.

The deadline is for the whole body, not for each read: a client that sends a byte now and then
(a slow POST) would otherwise hold its connection, one of --max-connections, for as long as it
likes, and enough of them lock everyone out, /health included.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpilot.runtime.server.admission import OBSERVATION_PATHS
from kvpilot.runtime.server.errors import APIError
from kvpilot.runtime.server.tenants import Tenant

# The body is not all read: the connection cannot carry another request.
_CLOSE = {"Connection": "close"}


def _too_large(limit: int) -> str:
    return f"the request body is larger than this server's limit of {limit} bytes (--max-request-body-bytes)"


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float,
                 count_response: Callable[[int, Tenant | None], None] = lambda status, tenant: None) -> None:
        """`count_response` hears the refusals it gives itself, ahead of the admission middleware
        that counts every other answer (the others reach the app and pass through it)."""
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.count_response = count_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            error = APIError(413, _too_large(self.max_bytes), code="request_too_large", headers=_CLOSE)
            await error.response()(scope, receive, send)
            if scope["path"] not in OBSERVATION_PATHS:
                self.count_response(413, None)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        received = 0
        body_done = False

        async def guarded_receive() -> Message:
            nonlocal received, body_done
            if body_done:
                # What comes after the body is the disconnect, which a stream waits for as long as it runs.
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                # HTTPExceptions: FastAPI's body parsing passes them on to the error handlers.
                raise HTTPException(408, f"the request body did not arrive within {self.timeout_s:g} s "
                                         "(--body-timeout)", headers=_CLOSE) from None
            if message["type"] != "http.request":
                body_done = True
                return message
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, _too_large(self.max_bytes), headers=_CLOSE)
            body_done = not message.get("more_body", False)
            return message

        await self.app(scope, guarded_receive, send)
