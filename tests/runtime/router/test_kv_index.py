"""The engine's KV-event publisher and a router's ReplicaKVIndex over real ZMQ sockets on loopback:
snapshots for late joiners, live stores and evictions, and recovery from lost batches, garbage and
a replay socket that does not answer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

import pytest

from kv_event_harness import WAIT_S, following, holds, loopback_config, until
from kvpilot.runtime.config import KVEventsConfig
from kvpilot.runtime.core.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from kvpilot.runtime.engine.kv_event_publisher import KVEventPublisher

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

BLOCK_SIZE = 16


def stored(*hashes: bytes) -> BlockStored:
    return BlockStored(list(hashes), None, [], BLOCK_SIZE)


class FaultyPublisher(KVEventPublisher):
    """The engine's publisher, told by the test to lose the next batch's seq or to send garbage first
    (what a slow subscriber's dropped message or a broken peer look like from the router)."""

    def __init__(self, *args, **kwargs) -> None:
        self.faults: list[Callable[[], None]] = []
        # Holds the publisher thread after each send while cleared: it answers no snapshot meanwhile.
        self.sending = threading.Event()
        self.sending.set()
        super().__init__(*args, **kwargs)

    def skip_a_seq(self) -> None:
        self._seq += 1

    def send_garbage_payload(self) -> None:
        self._pub.send_multipart([self._topic, (10**6).to_bytes(8, "big"), b"\xc1 is not msgpack"])

    def send_one_frame(self) -> None:
        self._pub.send_multipart([self._topic])

    def send_another_topic(self) -> None:
        self._pub.send_multipart([self._topic + b"-other", (10**6).to_bytes(8, "big"), b"not ours"])

    def _send(self, events: list[KVCacheEvent]) -> None:
        while self.faults:
            self.faults.pop(0)()
        super()._send(events)
        self.sending.wait(WAIT_S)


@contextlib.contextmanager
def publishing(config: KVEventsConfig, cached: Callable[[], list[bytes]] = list) -> Iterator[FaultyPublisher]:
    publisher = FaultyPublisher(config, BLOCK_SIZE, cached)
    try:
        yield publisher
    finally:
        publisher.close()


async def test_a_late_joiner_gets_the_whole_cache_then_follows_stores_and_evictions() -> None:
    config = loopback_config()
    with publishing(config) as publisher:
        publisher.publish([stored(b"a", b"b", b"c"), BlockRemoved([b"c"])])
        async with following(config, BLOCK_SIZE) as index:
            await until(holds(index, [b"a", b"b"]))
            publisher.publish([stored(b"d"), BlockRemoved([b"a"])])
            await until(lambda: index.prefix_blocks([b"b", b"d"]) == 2)
            assert index.prefix_blocks([b"a", b"b"]) == 0
            assert (index.resnapshots, index.bad_messages) == (0, 0)


async def test_a_skipped_seq_costs_one_log_line_and_a_resnapshot(caplog) -> None:
    config = loopback_config()
    with publishing(config) as publisher:
        async with following(config, BLOCK_SIZE) as index:
            await until(lambda: index.synced)
            publisher.faults.append(publisher.skip_a_seq)
            with caplog.at_level(logging.WARNING, "kvpilot.runtime.router.kv_index"):
                publisher.publish([stored(b"a")])
                await until(lambda: index.resnapshots == 1)
                await until(holds(index, [b"a"]))
            # Batch 0 is the engine's first, batch 1 answered the index's subscription.
            assert [r.getMessage() for r in caplog.records] == [
                "kv index replica-0: sequence gap: expected batch 2, got 3; resnapshotting in 0.05 s"]
            assert index.bad_messages == 0


@pytest.mark.parametrize("garbage", ["send_garbage_payload", "send_one_frame"])
async def test_garbage_is_logged_and_survived(caplog, garbage) -> None:
    config = loopback_config()
    with publishing(config) as publisher:
        async with following(config, BLOCK_SIZE) as index:
            await until(lambda: index.synced)
            publisher.faults.append(getattr(publisher, garbage))
            with caplog.at_level(logging.WARNING, "kvpilot.runtime.router.kv_index"):
                publisher.publish([stored(b"a", b"b")])
                await until(lambda: index.resnapshots == 1)
                await until(holds(index, [b"a", b"b"]))
            (line,) = [r.getMessage() for r in caplog.records]
            assert line.startswith("kv index replica-0: received ") and line.endswith("; resnapshotting in 0.05 s")
            assert index.bad_messages == 1
            publisher.publish([BlockRemoved([b"b"])])
            await until(holds(index, [b"a"]))


async def test_not_synced_until_the_resnapshot_lands() -> None:
    config = loopback_config()
    with publishing(config) as publisher:
        async with following(config, BLOCK_SIZE) as index:
            publisher.publish([stored(b"a")])
            await until(holds(index, [b"a"]))
            # The publisher thread stops after a batch with a gap: the gap is seen, the resnapshot not answered.
            publisher.sending.clear()
            publisher.faults.append(publisher.skip_a_seq)
            publisher.publish([stored(b"b")])
            await until(lambda: index.resnapshots == 1)
            await asyncio.sleep(0.2)
            assert not index.synced and index.prefix_blocks([b"a"]) == 0
            publisher.sending.set()
            await until(holds(index, [b"a", b"b"]))


async def test_a_replay_socket_that_does_not_answer_is_retried_until_it_does(caplog) -> None:
    config = loopback_config()
    with caplog.at_level(logging.WARNING, "kvpilot.runtime.router.kv_index"):
        async with following(config, BLOCK_SIZE, snapshot_timeout_s=0.1) as index:
            await until(lambda: index.resnapshots >= 2)
            assert not index.synced
            with publishing(config) as publisher:
                publisher.publish([stored(b"a")])
                await until(holds(index, [b"a"]))
    assert f"kv index replica-0: no snapshot from {config.replay_endpoint} in 0.1 s; resnapshotting in 0.05 s" in [
        r.getMessage() for r in caplog.records]


async def test_a_full_queue_drops_batches_and_the_next_one_carries_the_whole_cache() -> None:
    config = loopback_config(max_queue_size=1)
    cache = [b"x", b"y"]
    with publishing(config, cached=lambda: cache) as publisher:
        async with following(config, BLOCK_SIZE) as index:
            await until(lambda: index.synced)
            publisher.sending.clear()
            # At most one batch is taken by the held thread and one fills the queue: the third is dropped.
            for events in ([stored(b"a")], [stored(b"b")], [stored(b"c")]):
                publisher.publish(events)
            publisher.sending.set()
            await until(lambda: not publisher._queue)
            publisher.publish([stored(b"z")])
            await until(holds(index, [b"x", b"y"]))
            assert index.prefix_blocks([b"a"]) == index.prefix_blocks([b"z"]) == 0
            assert index.resnapshots == 0


async def test_another_topic_on_the_same_socket_is_not_ours() -> None:
    config = loopback_config(topic="kv")
    with publishing(config) as publisher:
        async with following(config, BLOCK_SIZE) as index:
            await until(lambda: index.synced)
            # SUB matches topics by prefix: "kv-other" reaches the index, which must ignore it.
            publisher.faults.append(publisher.send_another_topic)
            publisher.publish([stored(b"a")])
            await until(holds(index, [b"a"]))
            assert (index.resnapshots, index.bad_messages) == (0, 0)


async def test_a_router_joining_while_batches_flow_ends_up_exact_without_a_resnapshot() -> None:
    config = loopback_config()
    with publishing(config) as publisher:
        async with following(config, BLOCK_SIZE) as index:
            hashes = [bytes([i]) for i in range(60)]
            for block_hash in hashes:
                publisher.publish([stored(block_hash)])
                await asyncio.sleep(0.002)
            await until(holds(index, hashes))
            # The index asked for its snapshot once its subscription was answered: no batch fell between.
            assert index.resnapshots == 0


async def test_an_engine_hashing_other_block_sizes_is_never_synced(caplog) -> None:
    config = loopback_config()
    with publishing(config):
        async with following(config, BLOCK_SIZE // 2) as index:
            await until(lambda: index.bad_messages >= 1)
            assert not index.synced
    assert "received blocks of 16 tokens, where the router hashes 8" in caplog.text
