"""Publishes the engine's KV-cache events to routers, from a thread that never holds up a step.

The step loop hands each step's events to `publish`, which only appends them to a bounded queue.
The publisher thread wakes every BATCH_INTERVAL_S, sends what the steps queued since as one
numbered batch on a PUB socket, and answers snapshot requests on a ROUTER (replay) socket with
the whole cache at the latest seq sent: `[AllBlocksCleared, BlockStored(every cached hash)]`. It
knows the cache from a mirror of what it sent, so it never reads the block pool, which belongs to
the step loop. The first batch (seq 0) is `[AllBlocksCleared]`: a router that followed an earlier
life of this engine sees its seq restart and resnapshots. Each new subscription is answered with
an empty batch: once a subscriber has received a batch, it receives every later one, so it asks
for its snapshot then and misses nothing (a PUB socket drops what it sends before a subscription
reaches it, and nothing would tell the subscriber).

Why a ticking thread rather than one woken per step: a wake costs the step loop a socket send
and a switch of the GIL every step; a tick costs it nothing, and one batch per tick is what a
router needs (it learns of a step's blocks at most one interval late). An idle engine's thread
wakes as often, to find nothing.

Replay protocol (vLLM's, so that its subscribers work too): a request is `[b"", anything]` from a
DEALER or REQ socket; the reply is `[b"", seq, payload]`, then `[b"", END_OF_REPLAY, b""]`.

When the queue is full (the thread is starved of CPU), the step's events are dropped and the
next events queued are the whole cache instead, read from the pool on the step loop's own
thread: subscribers and the mirror come out exact without a resnapshot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

import msgspec
import zmq

from kvpilot.runtime.config import KVEventsConfig
from kvpilot.runtime.core.hashing import BlockHash
from kvpilot.runtime.core.kv_events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    KVCacheEvent,
    KVEventBatch,
    apply_events,
    encode_seq,
    whole_cache,
)

logger = logging.getLogger(__name__)

BATCH_INTERVAL_S = 0.01
# How long closing waits for the thread to send what is queued.
CLOSE_TIMEOUT_S = 2.0


class KVEventPublisher:
    """`publish` and `close` are called from one thread, the step loop's; neither blocks.

    The sockets are bound on construction, so that an address in use fails the engine's start.
    """

    def __init__(self, config: KVEventsConfig, block_size: int,
                 cached_block_hashes: Callable[[], Iterable[BlockHash]]) -> None:
        self.block_size = block_size
        self._cached_block_hashes = cached_block_hashes
        self._topic = config.topic.encode()
        # Appended by the step loop, popped by the thread: a deque's ends need no lock.
        self._queue: deque[list[KVCacheEvent]] = deque()
        self._max_queue_size = config.max_queue_size
        self._lost_events = False
        self._closing = threading.Event()
        # A context of its own, so that closing it ends exactly these sockets.
        self._context = zmq.Context()
        self._pub = self._bound(zmq.XPUB, config.endpoint, hwm=config.hwm)
        # Every subscription, also to a topic already subscribed to, is one to answer.
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._replay = self._bound(zmq.ROUTER, config.replay_endpoint)
        # The publisher thread's own: the last seq sent, and the cache as the batches sent so far say.
        self._seq = -1
        self._mirror: set[BlockHash] = set()
        self._encoder = msgspec.msgpack.Encoder()
        self._thread = threading.Thread(target=self._serve, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def _bound(self, kind: int, address: str, hwm: int | None = None) -> zmq.Socket:
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        if hwm is not None:
            socket.setsockopt(zmq.SNDHWM, hwm)
        try:
            socket.bind(address)
        except zmq.ZMQError as err:
            self._context.destroy(linger=0)
            raise RuntimeError(f"kv events: cannot bind {address}: {err}") from None
        return socket

    def publish(self, events: list[KVCacheEvent]) -> None:
        # Only this thread appends, so room seen here is still there at the append.
        if len(self._queue) >= self._max_queue_size:
            if not self._lost_events:
                logger.warning("kv events: the publisher thread is behind; the next batch carries the whole cache")
            self._lost_events = True
            return
        if self._lost_events:
            events = whole_cache(self._cached_block_hashes(), self.block_size)
            self._lost_events = False
        self._queue.append(events)

    def close(self) -> None:
        """Send what is queued (waiting at most CLOSE_TIMEOUT_S), then unbind."""
        self._closing.set()
        self._thread.join(CLOSE_TIMEOUT_S)
        self._context.destroy(linger=0)

    def _serve(self) -> None:
        self._send([AllBlocksCleared()])
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        poller.register(self._replay, zmq.POLLIN)
        while True:
            closing = self._closing.is_set()
            if self._queue:
                self._send(self._take_queued())
            if closing:
                return
            ready = dict(poller.poll(BATCH_INTERVAL_S * 1000))
            if self._pub in ready and self._someone_subscribed():
                self._send([])
            if self._replay in ready:
                snapshot = self._encoder.encode(KVEventBatch(time.time(), whole_cache(self._mirror, self.block_size)))
                while self._replay.poll(0):
                    self._answer_snapshot(self._replay.recv_multipart(), snapshot)

    def _someone_subscribed(self) -> bool:
        subscribed = False
        while self._pub.poll(0):
            # b"\x01" + topic subscribes, b"\x00" + topic unsubscribes.
            subscribed |= self._pub.recv().startswith(b"\x01")
        return subscribed

    def _take_queued(self) -> list[KVCacheEvent]:
        events = []
        for _ in range(len(self._queue)):
            events.extend(self._queue.popleft())
        return events

    def _send(self, events: list[KVCacheEvent]) -> None:
        self._seq += 1
        apply_events(self._mirror, events)
        payload = self._encoder.encode(KVEventBatch(time.time(), events))
        self._pub.send_multipart([self._topic, encode_seq(self._seq), payload], copy=False)

    def _answer_snapshot(self, request: list[bytes], snapshot: bytes) -> None:
        identity, *frames = request
        if len(frames) != 2 or frames[0] != b"":
            logger.warning("kv events: ignored a replay request of %d frames (expected an empty frame, then "
                           "one more)", len(frames))
            return
        self._replay.send_multipart([identity, b"", encode_seq(self._seq), snapshot])
        self._replay.send_multipart([identity, b"", END_OF_REPLAY, b""])
