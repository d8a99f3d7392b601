"""Held requests: bounded, released in (priority, arrival) order one at a time, timed out cleanly."""

import asyncio

import pytest

from kvpilot.runtime.router.held import HeldRequests, HoldQueueFull


async def test_released_in_priority_then_arrival_order():
    held = HeldRequests(capacity=8)
    resumed = []

    async def request(name, priority):
        pass_on = await held.wait(priority, timeout=5)
        resumed.append(name)
        await asyncio.sleep(0.01)  # sending: the next waits for it
        assert resumed[-1] == name
        pass_on()
        pass_on()  # once only: a second call lets no one else go

    tasks = [asyncio.create_task(request(n, p)) for n, p in [("low-1", 5), ("high", 0), ("low-2", 5), ("mid", 2)]]
    await asyncio.sleep(0)
    assert len(held) == 4
    held.release()
    await asyncio.gather(*tasks)
    assert resumed == ["high", "mid", "low-1", "low-2"]
    assert len(held) == 0


async def test_one_waiting_again_after_its_turn_waits_for_the_next_release():
    held = HeldRequests(capacity=4)
    first = asyncio.create_task(held.wait(0, timeout=5))
    await asyncio.sleep(0)
    held.release()
    (await first)()  # the replica went away again before it was sent
    again = asyncio.create_task(held.wait(0, timeout=5))
    await asyncio.sleep(0.01)
    assert not again.done() and len(held) == 1
    held.release()
    assert callable(await again)


async def test_a_waiter_whose_turn_comes_as_it_leaves_passes_the_turn_on():
    held = HeldRequests(capacity=4)
    leaving = asyncio.create_task(held.wait(0, timeout=5))
    staying = asyncio.create_task(held.wait(1, timeout=5))
    await asyncio.sleep(0)
    held.release()  # leaving's turn...
    leaving.cancel()  # ...as its client goes
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert callable(await asyncio.wait_for(staying, 1))


async def test_a_full_queue_refuses_at_once_and_a_timeout_frees_the_place():
    held = HeldRequests(capacity=1)
    waiter = asyncio.create_task(held.wait(0, timeout=0.05))
    await asyncio.sleep(0)
    with pytest.raises(HoldQueueFull):
        await held.wait(0, timeout=5)
    assert await waiter is None
    assert len(held) == 0


async def test_a_cancelled_waiter_is_skipped():
    held = HeldRequests(capacity=4)
    gone = asyncio.create_task(held.wait(0, timeout=5))
    stays = asyncio.create_task(held.wait(1, timeout=5))
    await asyncio.sleep(0)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert len(held) == 1
    held.release()
    assert callable(await stays)
