"""A server-sent-event response that ends when its client goes away or stops reading.

uvicorn applies TCP flow control: once the client's window and the socket buffers are full, a
send waits until the client reads. A send that waits longer than the stall timeout ends the
stream: the event generator is closed, which aborts the request in the engine, frees its KV
blocks and, when the response ends, releases its tenant's sequences; the connection is dropped.
A client that disconnects ends the stream the same way, seen by a task that waits on `receive`
for the disconnect (what Starlette's StreamingResponse does with an anyio task group, which costs
more than the plain task and a flag here).

The chunks between the response's start and its end go out through the connection's body writer
(body_writer.py) where it has one, without a coroutine per chunk unless the transport is paused.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvpilot.runtime.server.body_writer import BODY_WRITER, BodyWriter
from kvpilot.runtime.server.connections import ABORT_CONNECTION

logger = logging.getLogger(__name__)


class StallingStreamingResponse(StreamingResponse):
    def __init__(self, content, stall_timeout_s: float, on_stall: Callable[[], None], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.stall_timeout_s = stall_timeout_s
        self.on_stall = on_stall

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        extensions = scope.get("extensions", {})
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        # Why this task was cancelled, when it was this response that cancelled it.
        ended_by: str | None = None
        sending_since: float | None = None

        def end(reason: str) -> None:
            nonlocal ended_by
            if ended_by is None:
                ended_by = reason
                task.cancel()

        async def listen_for_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            end("disconnect")

        # One watchdog timer per stream, not a timeout per send: asyncio.wait_for costs a task and
        # a timer for each of the thousands of sends a stream makes, nearly all of which complete
        # at once (a send only waits while the transport is paused).
        def watch() -> None:
            nonlocal timer
            now = loop.time()
            if sending_since is not None and now - sending_since >= self.stall_timeout_s:
                end("stall")
                return
            timer = loop.call_at((now if sending_since is None else sending_since) + self.stall_timeout_s, watch)

        async def watched(sending: Awaitable[None]) -> None:
            nonlocal sending_since
            sending_since = loop.time()
            await sending
            sending_since = None

        writer: BodyWriter | None = extensions.get(BODY_WRITER)

        async def send_body() -> None:
            async for chunk in self.body_iterator:
                if not isinstance(chunk, bytes):
                    chunk = chunk.encode(self.charset)
                if writer is None:
                    await watched(send({"type": "http.response.body", "body": chunk, "more_body": True}))
                    continue
                if writer.must_wait():
                    await watched(writer.drain())
                writer.write(chunk)

        listener = asyncio.create_task(listen_for_disconnect())
        timer = loop.call_later(self.stall_timeout_s, watch)
        try:
            await watched(send({"type": "http.response.start", "status": self.status_code,
                                "headers": self.raw_headers}))
            # A task of its own: this one runs inside every middleware's and the router's
            # coroutine, some twenty frames that each wake-up (one per chunk) would resume in
            # turn. Cancelling this task (end()) cancels that one, which it awaits.
            await asyncio.create_task(send_body())
            if writer is not None:
                writer.flush()
            ended_by = "end"  # the last send completes the response, which the listener sees as a disconnect
            await watched(send({"type": "http.response.body", "body": b"", "more_body": False}))
        except asyncio.CancelledError:
            if ended_by not in ("disconnect", "stall"):
                raise
            task.uncancel()
            # Closing the generator aborts the request in the engine (its aclosing block).
            await self.body_iterator.aclose()
            if ended_by == "stall":
                logger.warning("aborted a stream whose client read nothing for %g s", self.stall_timeout_s)
                self.on_stall()
                abort_connection = extensions.get(ABORT_CONNECTION)
                if abort_connection is not None:
                    abort_connection()
        finally:
            timer.cancel()
            listener.cancel()
            if writer is not None:
                # Whatever ends the stream writes after it (the drain's error event): in order.
                writer.flush()
