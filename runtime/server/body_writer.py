"""A streamed response's body chunks written straight to the connection, past the ASGI send chain.

Every `send` of a body chunk goes through each middleware's send wrapper, uvicorn's cycle and
h11's event machinery: some 15 us of the API server's CPU per chunk, about as much as the socket
write itself, and a stream sends one chunk per token. The chunks in the middle of a response need
none of that: the middlewares only look at the response start and its end, and h11 does not count
the bytes of a chunked body. So the response start and the last message still take the ASGI path,
and the chunks between them are framed here, with uvicorn's flow control (a paused transport
waits) and its disconnect check kept.

The chunks a connection gets within one turn of the event loop go out in one socket write, at the
end of that turn: one write per stream per engine step however many outputs of the stream the
step's message (or a backlog of them) held, and the writes of all the streams of a step back to
back, from one callback, while the client side is still awake to read them.
"""

from __future__ import annotations

import asyncio
import weakref

from uvicorn.protocols.http.h11_impl import RequestResponseCycle

# An ASGI scope extension: the connection's BodyWriter, for a response whose start was sent.
BODY_WRITER = "kvpilot.body_writer"


class _TurnFlush:
    """The writers of one event loop with chunks queued in this turn, flushed by one callback."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._writers: list[BodyWriter] = []

    def add(self, writer: BodyWriter) -> None:
        if not self._writers:
            self._loop.call_soon(self._flush)
        self._writers.append(writer)

    def _flush(self) -> None:
        writers, self._writers = self._writers, []
        for writer in writers:
            writer.flush()


_turn_flushes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _TurnFlush] = weakref.WeakKeyDictionary()


class BodyWriter:
    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle
        loop = asyncio.get_running_loop()
        self._turn_flush = _turn_flushes.get(loop)
        if self._turn_flush is None:
            self._turn_flush = _turn_flushes[loop] = _TurnFlush(loop)
        self._pending: list[bytes] = []

    def must_wait(self) -> bool:
        """Whether the transport is paused (a client that does not read): drain() before writing."""
        return self._cycle.flow.write_paused and not self._cycle.disconnected

    async def drain(self) -> None:
        await self._cycle.flow.drain()

    def write(self, chunk: bytes) -> None:
        """Queue one chunk, for the socket write at the end of this turn of the loop."""
        cycle = self._cycle
        # As uvicorn's own send: a chunk for a client that left is dropped (the disconnect ends
        # the stream from the receive side).
        if cycle.disconnected or not chunk:
            return
        if not cycle.response_started or cycle.response_complete:
            raise RuntimeError("a body chunk outside a streamed response")
        if not self._pending:
            self._turn_flush.add(self)
        self._pending.append(b"%x\r\n%s\r\n" % (len(chunk), chunk))

    def flush(self) -> None:
        """Write what is queued; the response's last message must not go out before it."""
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            if not self._cycle.disconnected:
                self._cycle.transport.write(data)


def body_writer(cycle: RequestResponseCycle) -> BodyWriter | None:
    """The writer for `cycle`'s response body; None where h11 would not frame it as chunked (an
    HTTP/1.0 client, whose body is delimited by the connection closing; a HEAD request, which has none)."""
    if cycle.conn.their_http_version != b"1.1" or cycle.scope["method"] == "HEAD":
        return None
    return BodyWriter(cycle)
