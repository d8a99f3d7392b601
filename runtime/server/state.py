"""What the whole server is doing: serving, draining after SIGTERM, or dead with its engine."""

from __future__ import annotations

import asyncio


class ServerState:
    def __init__(self) -> None:
        self.draining = False
        self.dead_reason: str | None = None
        # Set when the drain gave up and cancelled what was left (see abort_in_flight).
        self.aborting = False
        # The tasks serving the requests in flight.
        self._in_flight: set[asyncio.Task] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def status(self) -> str:
        if self.dead_reason is not None:
            return "dead"
        return "draining" if self.draining else "ok"

    def mark_dead(self, reason: str) -> None:
        self.dead_reason = reason

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def request_started(self) -> None:
        self._in_flight.add(asyncio.current_task())
        self._idle.clear()

    def request_finished(self) -> None:
        self._in_flight.discard(asyncio.current_task())
        if not self._in_flight:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True once no request is in flight; False if some still are after `timeout` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def abort_in_flight(self) -> None:
        """Cancels every request in flight; each answers 503 if it had not started answering."""
        self.aborting = True
        for task in self._in_flight:
            task.cancel()
