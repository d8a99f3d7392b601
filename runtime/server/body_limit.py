"""413 for a request body over --max-request-body-bytes, before any of it is parsed.

A declared Content-Length over the limit is refused before a byte of the body is read; a chunked
body is counted as it arrives and refused at the chunk that crosses the limit, so the server
never holds more than the limit of any one body.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpilot.runtime.server.errors import APIError


def _message(limit: int) -> str:
    return f"the request body is larger than this server's limit of {limit} bytes (--max-request-body-bytes)"


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            error = APIError(413, _message(self.max_bytes), code="request_too_large",
                             headers={"Connection": "close"})
            await error.response()(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # An HTTPException: FastAPI's body parsing passes it on to the error handlers.
                    raise HTTPException(413, _message(self.max_bytes), headers={"Connection": "close"})
            return message

        await self.app(scope, counting_receive, send)
