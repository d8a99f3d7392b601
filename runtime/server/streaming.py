"""A server-sent-event response that gives up on a client that stops reading.

uvicorn applies TCP flow control: once the client's window and the socket buffers are full, a
send waits until the client reads. A send that waits longer than the stall timeout ends the
stream: the event generator is closed, which aborts the request in the engine, frees its KV
blocks and, when the response ends, releases its tenant's sequences; the connection is dropped.

The chunks between the response's start and its end go out through the connection's body writer
(body_writer.py) where it has one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from kvpilot.runtime.server.body_writer import BODY_WRITER, BodyWriter
from kvpilot.runtime.server.connections import ABORT_CONNECTION

logger = logging.getLogger(__name__)


class StallingStreamingResponse(StreamingResponse):
    def __init__(self, content, stall_timeout_s: float, on_stall: Callable[[], None], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.stall_timeout_s = stall_timeout_s
        self.on_stall = on_stall
        self._abort_connection: Callable[[], None] | None = None
        self._body_writer: BodyWriter | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        extensions = scope.get("extensions", {})
        self._abort_connection = extensions.get(ABORT_CONNECTION)
        self._body_writer = extensions.get(BODY_WRITER)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        # One watchdog timer per stream, not a timeout per send: asyncio.wait_for costs a task and
        # a timer for each of the thousands of sends a stream makes, nearly all of which complete
        # at once (a send only waits while the transport is paused).
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        sending_since: float | None = None
        stalled = False

        def watch() -> None:
            nonlocal stalled, timer
            now = loop.time()
            if sending_since is not None and now - sending_since >= self.stall_timeout_s:
                stalled = True
                task.cancel()
                return
            timer = loop.call_at((now if sending_since is None else sending_since) + self.stall_timeout_s, watch)

        async def watched(sending: Awaitable[None]) -> None:
            nonlocal sending_since
            sending_since = loop.time()
            await sending
            sending_since = None

        timer = loop.call_later(self.stall_timeout_s, watch)
        try:
            await watched(send({"type": "http.response.start", "status": self.status_code,
                                "headers": self.raw_headers}))
            async for chunk in self.body_iterator:
                if not isinstance(chunk, bytes):
                    chunk = chunk.encode(self.charset)
                if self._body_writer is not None:
                    await watched(self._body_writer.write(chunk))
                else:
                    await watched(send({"type": "http.response.body", "body": chunk, "more_body": True}))
            if self._body_writer is not None:
                self._body_writer.flush()
            await watched(send({"type": "http.response.body", "body": b"", "more_body": False}))
        except asyncio.CancelledError:
            if not stalled:
                raise
            task.uncancel()
            logger.warning("aborted a stream whose client read nothing for %g s", self.stall_timeout_s)
            self.on_stall()
            # Closing the generator aborts the request in the engine (its aclosing block).
            await self.body_iterator.aclose()
            if self._abort_connection is not None:
                self._abort_connection()
        finally:
            timer.cancel()
            if self._body_writer is not None:
                # Whatever ends the stream writes after it (the drain's error event): in order.
                self._body_writer.flush()
