"""The router's hold: a request that arrives while no replica is ready waits for the first one to
become ready, or fails once it has waited holdTimeoutSeconds (the router's 503 with Retry-After).
Pure: times are passed in."""

from __future__ import annotations

from collections import deque


class Hold:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        # (arrival, request index), in arrival order: with one timeout, also in deadline order.
        self.held: deque[tuple[float, int]] = deque()

    def __len__(self) -> int:
        return len(self.held)

    def add(self, index: int, arrival: float) -> None:
        self.held.append((arrival, index))

    def expire(self, now: float) -> list[tuple[int, float]]:
        """Those that waited past the timeout by `now`, gone from the hold: (index, when it failed)."""
        expired = []
        while self.held and self.held[0][0] + self.timeout < now:
            arrival, index = self.held.popleft()
            expired.append((index, arrival + self.timeout))
        return expired

    def release(self) -> list[int]:
        """Every request still held, in arrival order: a replica is ready."""
        released = [index for _, index in self.held]
        self.held.clear()
        return released
