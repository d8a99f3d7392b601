"""Requests waiting for a ready replica (the fleet scaled to zero, or every replica restarting).

They wait in a bounded queue and go in (priority, arrival) order, priority as the engine orders
it (lower first), when a replica becomes ready. Released waiters resume in the order they were
released, so the replica receives the most urgent first.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


class HoldQueueFull(Exception):
    pass


class HeldRequests:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._queue: list[tuple[int, int, asyncio.Future]] = []
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return sum(1 for *_, future in self._queue if not future.done())

    async def wait(self, priority: int, timeout: float) -> bool:
        """Waits for `release`: True when released, False after `timeout` seconds; HoldQueueFull at once
        when `capacity` requests wait already."""
        if len(self) >= self.capacity:
            raise HoldQueueFull(f"{self.capacity} requests are held already")
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._queue, (priority, next(self._arrivals), future))
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            # A waiter that timed out or was cancelled (its client left) is skipped by `release`.
            future.cancel()

    def release(self) -> None:
        """Every waiter goes, the most urgent first."""
        queue, self._queue = self._queue, []
        while queue:
            *_, future = heapq.heappop(queue)
            if not future.done():
                future.set_result(None)
