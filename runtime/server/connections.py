"""uvicorn's HTTP/1.1 protocol with the guards it lacks, and the fast path for a stream's body
chunks (body_writer.py). The guards: a deadline for a new connection's request head; a cap on
open connections, with a few more kept for the probes; a bounded kernel send buffer per
connection; a reset for a client that stops taking a finished response; and OpenAI's error
shape for what is not HTTP at all.

uvicorn closes a keep-alive connection that stays idle after a response (--timeout-keep-alive,
which also covers a later request head that never completes), but waits forever for the first
request of a connection: a slowloris client holds connections open by sending its headers a
byte at a time, or never. And Linux grows a socket's send buffer up to `tcp_wmem`'s maximum
(4 MiB by default) for a client that does not read: a bound keeps that memory small, and makes
such a client's stall visible to the server (streaming.py) after little output.

A request refused before its body was read (413, 408) gets its answer, and then a lingering close
as nginx does it: the server shuts its side, then reads and drops what the client still sends,
for a bounded time, before it closes. A plain close with unread data resets the connection, and a
reset makes the client's kernel drop what it has not delivered yet, the answer included: the client
would see a connection reset while still sending, and never the 413 that explains it.

A response that is complete on the server's side may still sit in the connection's buffer, for
a client that does not read: uvicorn then closes the connection (after --timeout-keep-alive, or at
once for `Connection: close`), and a close waits for the buffer to drain, which for that client is
never. Such a connection is reset once the client has taken nothing of it for the stall timeout,
the rule streaming.py applies while a stream runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import struct

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvpilot.runtime.server.body_writer import BODY_WRITER, body_writer
from kvpilot.runtime.server.errors import bad_request
from kvpilot.runtime.server.limits import ServerLimits

logger = logging.getLogger(__name__)

# An ASGI scope extension: how a response hangs up on a client that stopped reading. A plain
# close would first wait for the unread buffer to drain, which for such a client is forever.
ABORT_CONNECTION = "kvpilot.abort_connection"
# Connections beyond --max-connections let in for the observation routes alone (/health, /metrics,
# /version; admission.py refuses the others): the kubelet's probes and the operator's scrapes get
# through a saturated server, which would otherwise be restarted, its work lost, when it is busiest.
OBSERVATION_RESERVE = 8
# An ASGI scope extension, set on the request of a connection in that reserve.
OVER_CAPACITY = "kvpilot.over_capacity"
_CLOSE = (b"connection", b"close")
# A lingering close (nginx's lingering_time and lingering_timeout): how long the server goes on
# dropping a refused body in all, and how long it waits for the next piece of it.
LINGERING_TIME_S = 30.0
LINGERING_TIMEOUT_S = 5.0


def guarded_protocol(limits: ServerLimits) -> type[H11Protocol]:
    """The protocol class to give uvicorn.Config(http=...)."""
    header_timeout_s, max_connections = limits.header_timeout_s, limits.max_connections
    send_buffer_bytes, stall_timeout_s = limits.socket_send_buffer_bytes, limits.stream_stall_timeout_s

    # The sockets in a lingering close: no longer connections, but bounded as they are.
    lingering: set[asyncio.Task] = set()

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _unsent_timer: asyncio.TimerHandle | None = None
        _over_capacity = False
        _linger = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections + OBSERVATION_RESERVE:
                logger.warning("refused a connection: %d are open already (--max-connections, and %d more for "
                               "/health and /metrics)", max_connections, OBSERVATION_RESERVE)
                transport.close()
                return
            self._over_capacity = len(self.connections) > max_connections
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
                # asyncio sets this only on sockets made with proto=IPPROTO_TCP, which ours is not.
                # With Nagle's algorithm on, the write after a response's head waits for the
                # client's ACK, and on a reused keep-alive connection the client delays it (up to
                # 40 ms): every request there but the first got its first token that much later.
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._header_timer = self.loop.call_later(header_timeout_s, self._head_overdue)

        def handle_events(self) -> None:
            super().handle_events()
            if self.scope is not None:
                # The request's task has not started yet: it will see the extension.
                extensions = self.scope.setdefault("extensions", {})
                extensions[ABORT_CONNECTION] = self._reset
                if self._over_capacity:
                    extensions[OVER_CAPACITY] = True
                    # One request and the connection goes (its answer says so): the reserve is
                    # for probes, never for keeping.
                    if _CLOSE not in self.scope["headers"]:
                        self.scope["headers"].append(_CLOSE)
                if self.cycle is not None and self.cycle.scope is self.scope:
                    extensions[BODY_WRITER] = body_writer(self.cycle)
            if self.cycle is not None and self._header_timer is not None:
                # The first request head arrived; uvicorn's keep-alive timer guards later ones.
                self._header_timer.cancel()
                self._header_timer = None

        def on_response_complete(self) -> None:
            # Closing, with the client still sending the body the answer refused.
            self._linger = self.transport.is_closing() and self.conn.their_state is h11.SEND_BODY
            super().on_response_complete()
            if self._unsent_timer is None:
                self._watch_unsent(None)

        def _watch_unsent(self, before: int | None) -> None:
            self._unsent_timer = None
            unsent = self.transport.get_write_buffer_size()
            if unsent == 0:
                return
            if before is not None and unsent >= before:
                logger.warning("reset a connection whose client took none of its response for %g s", stall_timeout_s)
                self._reset()
                return
            self._unsent_timer = self.loop.call_later(stall_timeout_s, self._watch_unsent, unsent)

        def _reset(self) -> None:
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                # A reset: a plain close leaves the kernel sending the unsent rest to a client that
                # never takes it, holding the send buffer for minutes.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()

        def connection_lost(self, exc: Exception | None) -> None:
            for timer in (self._header_timer, self._unsent_timer):
                if timer is not None:
                    timer.cancel()
            if self._linger and exc is None and len(lingering) < max_connections:
                # The transport has sent all it had and closes its socket after this call: a copy
                # of the descriptor keeps the connection open for the lingering close.
                sock = self.transport.get_extra_info("socket")
                if sock is not None:
                    copy = socket.socket(fileno=os.dup(sock.fileno()))
                    task = self.loop.create_task(_lingering_close(copy))
                    lingering.add(task)
                    task.add_done_callback(lingering.discard)
            super().connection_lost(exc)
            # uvicorn drops its keep-alive timer only on a clean close: after a reset the timer
            # would hold the connection's objects for the whole --timeout-keep-alive (75 s).
            self._unset_keepalive_if_required()

        def send_400_response(self, msg: str) -> None:
            # What h11 cannot parse: uvicorn answers it in plain text, every other error here is
            # OpenAI's JSON.
            body = json.dumps(bad_request("the request is not valid HTTP/1.1").body()).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), _CLOSE]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

        def _head_overdue(self) -> None:
            self._header_timer = None
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol


async def _lingering_close(sock: socket.socket) -> None:
    """Shut the server's side of a connection, then drop what the client still sends until it
    closes its side or the lingering time runs out; then close."""
    loop = asyncio.get_running_loop()
    try:
        sock.setblocking(False)
        sock.shutdown(socket.SHUT_WR)
        async with asyncio.timeout(LINGERING_TIME_S):
            while True:
                async with asyncio.timeout(LINGERING_TIMEOUT_S):
                    if not await loop.sock_recv(sock, 65536):
                        return
    except (OSError, TimeoutError):
        pass
    finally:
        sock.close()
