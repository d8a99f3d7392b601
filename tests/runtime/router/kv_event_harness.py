"""A router's ReplicaKVIndex following an engine's KV-event publisher on loopback, for the tests."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable

import pytest

from kvpilot.runtime.config import KVEventsConfig
from kvpilot.runtime.router.kv_index import ReplicaKVIndex

WAIT_S = 10.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def loopback_config(**fields) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{free_port()}",
                          replay_endpoint=f"tcp://127.0.0.1:{free_port()}", **fields)


@contextlib.asynccontextmanager
async def following(config: KVEventsConfig, block_size: int, **options):
    """A ReplicaKVIndex named replica-0, running for the `async with` block."""
    index = ReplicaKVIndex("replica-0", config.endpoint, config.replay_endpoint, config.topic, block_size, **options)
    task = asyncio.create_task(index.run())
    try:
        yield index
    finally:
        index.close()
        with pytest.raises(asyncio.CancelledError):
            await task


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT_S):
        while not condition():
            await asyncio.sleep(0.01)


def holds(index: ReplicaKVIndex, hashes: list[bytes]) -> Callable[[], bool]:
    """The index is synced and holds exactly `hashes`."""
    return lambda: index.num_blocks == len(hashes) and index.prefix_blocks(hashes) == len(hashes)
