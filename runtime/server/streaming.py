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

        async def watched_send(message: Message) -> None:
            nonlocal sending_since
            sending_since = loop.time()
            await send(message)
            sending_since = None

        timer = loop.call_later(self.stall_timeout_s, watch)
        try:
            await super().stream_response(watched_send)
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
