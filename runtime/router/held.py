"""Requests waiting for a ready replica (the fleet scaled to zero, or every replica restarting).

They wait in a bounded queue and go in (priority, arrival) order, priority as the engine orders
it (lower first), when a replica becomes ready: one at a time, each when the one before it has
sent its request (`wait` hands each a one-shot `pass_on` for that). Let go all at once, they
would open their connections together, and a replica would receive them in whatever order the
connections happened to be made: the most urgent is meant to be first.

Invariants:
- `release` lets go only the requests waiting when it is called; one that waits again (the
  replica went away before it was sent) waits for the next `release`.
- At most one released request holds the turn; it passes it on once, when it has sent its
  request, gives up, or leaves. One released as it timed out or left passes it on itself.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable

_Waiter = tuple[int, int, asyncio.Future]


class HoldQueueFull(Exception):
    pass


class HeldRequests:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._queue: list[_Waiter] = []
        # Released by the last `release`, not yet let go, in order.
        self._releasing: list[_Waiter] = []
        self._turn_taken = False
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return sum(1 for *_, future in self._queue + self._releasing if not future.done())

    async def wait(self, priority: int, timeout: float) -> Callable[[], None] | None:
        """Waits for its turn after `release`, and returns the `pass_on` to call once its request
        is sent; None after `timeout` seconds. HoldQueueFull at once when `capacity` requests wait
        already."""
        if len(self) >= self.capacity:
            raise HoldQueueFull(f"{self.capacity} requests are held already")
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._queue, (priority, next(self._arrivals), future))
        let_go = False
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(future)
            let_go = True
        except TimeoutError:
            return None
        finally:
            if not let_go and future.done() and not future.cancelled():
                self._let_next()  # its turn came as it timed out or left: the next takes it
            # A waiter that timed out or was cancelled (its client left) is skipped by `_let_next`.
            future.cancel()
        return self._turn()

    def release(self) -> None:
        """Every request waiting now goes, the most urgent first, each after the one before it."""
        for waiter in self._queue:
            heapq.heappush(self._releasing, waiter)
        self._queue = []
        if not self._turn_taken:
            self._let_next()

    def _let_next(self) -> None:
        while self._releasing:
            *_, future = heapq.heappop(self._releasing)
            if not future.done():
                future.set_result(None)
                self._turn_taken = True
                return
        self._turn_taken = False

    def _turn(self) -> Callable[[], None]:
        passed = False

        def pass_on() -> None:
            nonlocal passed
            if not passed:
                passed = True
                self._let_next()

        return pass_on
