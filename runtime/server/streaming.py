"""A server-sent-event response that gives up on a client that stops reading.

uvicorn applies TCP flow control: once the client's window and the socket buffers are full, a
send waits until the client reads. A send that waits longer than the stall timeout ends the
stream: the event generator is closed, which aborts the request in the engine, frees its KV
blocks and, when the response ends, releases its tenant's sequences; the connection is dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from kvpilot.runtime.server.connections import ABORT_CONNECTION

logger = logging.getLogger(__name__)


class ClientStalled(Exception):
    pass


class StallingStreamingResponse(StreamingResponse):
    def __init__(self, content, stall_timeout_s: float, on_stall: Callable[[], None], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.stall_timeout_s = stall_timeout_s
        self.on_stall = on_stall
        self._abort_connection: Callable[[], None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._abort_connection = scope.get("extensions", {}).get(ABORT_CONNECTION)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        async def bounded_send(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self.stall_timeout_s)
            except TimeoutError:
                raise ClientStalled from None

        try:
            await super().stream_response(bounded_send)
        except ClientStalled:
            logger.warning("aborted a stream whose client read nothing for %g s", self.stall_timeout_s)
            self.on_stall()
            # Closing the generator aborts the request in the engine (its aclosing block).
            await self.body_iterator.aclose()
            if self._abort_connection is not None:
                self._abort_connection()
