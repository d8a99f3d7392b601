"""uvicorn's HTTP/1.1 protocol with the guards it lacks: a deadline for a new connection's
request head, a cap on open connections, and a bounded kernel send buffer per connection; and
the fast path for a stream's body chunks (body_writer.py).

uvicorn closes a keep-alive connection that stays idle after a response (--timeout-keep-alive,
which also covers a later request head that never completes), but waits forever for the first
request of a connection: a slowloris client holds connections open by sending its headers a
byte at a time, or never. And Linux grows a socket's send buffer up to `tcp_wmem`'s maximum
(4 MiB by default) for a client that does not read: a bound keeps that memory small, and makes
such a client's stall visible to the server (streaming.py) after little output.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from uvicorn.protocols.http.h11_impl import H11Protocol

from kvpilot.runtime.server.body_writer import BODY_WRITER, body_writer

logger = logging.getLogger(__name__)

# An ASGI scope extension: how a response hangs up on a client that stopped reading. A plain
# close would first wait for the unread buffer to drain, which for such a client is forever.
ABORT_CONNECTION = "kvpilot.abort_connection"


def guarded_protocol(header_timeout_s: float, max_connections: int, send_buffer_bytes: int) -> type[H11Protocol]:
    """The protocol class to give uvicorn.Config(http=...)."""

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                logger.warning("refused a connection: %d are open already (--max-connections)", max_connections)
                transport.close()
                return
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
            self._header_timer = self.loop.call_later(header_timeout_s, self._head_overdue)

        def handle_events(self) -> None:
            super().handle_events()
            if self.scope is not None:
                # The request's task has not started yet: it will see the extension.
                extensions = self.scope.setdefault("extensions", {})
                extensions[ABORT_CONNECTION] = self.transport.abort
                if self.cycle is not None and self.cycle.scope is self.scope:
                    extensions[BODY_WRITER] = body_writer(self.cycle)
            if self.cycle is not None and self._header_timer is not None:
                # The first request head arrived; uvicorn's keep-alive timer guards later ones.
                self._header_timer.cancel()
                self._header_timer = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)
            # uvicorn drops its keep-alive timer only on a clean close: after a reset the timer
            # would hold the connection's objects for the whole --timeout-keep-alive (75 s).
            self._unset_keepalive_if_required()

        def _head_overdue(self) -> None:
            self._header_timer = None
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol
