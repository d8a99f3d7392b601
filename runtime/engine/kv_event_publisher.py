"""Publishes the engine's KV-cache events to routers, from a thread that never holds up a step.

The step loop hands each step's events to `publish`, which only queues them. The publisher
thread numbers and sends them on a PUB socket, and answers snapshot requests on a ROUTER (replay)
socket with the whole cache at the latest seq sent: `[AllBlocksCleared, BlockStored(every cached
hash)]`. It knows the cache from a mirror of what it sent, so it never reads the block pool,
which belongs to the step loop. The first batch (seq 0) is `[AllBlocksCleared]`: a router that
followed an earlier life of this engine sees its seq restart and resnapshots.

Replay protocol (vLLM's, so that its subscribers work too): a request is `[b"", anything]` from a
DEALER or REQ socket; the reply is `[b"", seq, payload]`, then `[b"", END_OF_REPLAY, b""]`.

When the queue is full (the thread is starved of CPU), the step's events are dropped and the
next batch that fits carries the whole cache instead, read from the pool on the step loop's own
thread: subscribers and the mirror come out exact without a resnapshot.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
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

# How long closing waits for the thread to send what is queued.
CLOSE_TIMEOUT_S = 2.0

_wake_addresses = itertools.count()


class KVEventPublisher:
    """`publish` and `close` are called from one thread, the step loop's; neither blocks on I/O.

    The sockets are bound on construction, so that an address in use fails the engine's start.
    """

    def __init__(self, config: KVEventsConfig, block_size: int,
                 cached_block_hashes: Callable[[], Iterable[BlockHash]]) -> None:
        self.block_size = block_size
        self._cached_block_hashes = cached_block_hashes
        self._topic = config.topic.encode()
        self._queue: queue.Queue[list[KVCacheEvent] | None] = queue.Queue(config.max_queue_size)
        self._lost_events = False
        # A context of its own, so that closing it ends exactly these sockets.
        self._context = zmq.Context()
        self._pub = self._bound(zmq.PUB, config.endpoint, hwm=config.hwm)
        self._replay = self._bound(zmq.ROUTER, config.replay_endpoint)
        # The step loop wakes the thread through a socket, so that one poll waits for both.
        wake_address = f"inproc://kv-events-wake-{next(_wake_addresses)}"
        self._wake_receiver = self._bound(zmq.PAIR, wake_address)
        self._wake = self._context.socket(zmq.PAIR)
        self._wake.connect(wake_address)
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
        # Only this thread puts, so room seen here is still there at the put.
        if self._queue.full():
            if not self._lost_events:
                logger.warning("kv events: the publisher thread is behind; the next batch carries the whole cache")
            self._lost_events = True
            return
        if self._lost_events:
            events = whole_cache(self._cached_block_hashes(), self.block_size)
            self._lost_events = False
        self._queue.put_nowait(events)
        self._wake_thread()

    def close(self) -> None:
        """Send what is queued (for at most CLOSE_TIMEOUT_S), then unbind."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=CLOSE_TIMEOUT_S)
        self._wake_thread()
        self._thread.join(CLOSE_TIMEOUT_S)
        self._wake.close()
        self._context.destroy(linger=0)

    def _wake_thread(self) -> None:
        try:
            self._wake.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # wakes it has not read yet are enough: it empties the whole queue on each

    def _serve(self) -> None:
        self._send([AllBlocksCleared()])
        poller = zmq.Poller()
        poller.register(self._wake_receiver, zmq.POLLIN)
        poller.register(self._replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._wake_receiver in ready:
                while self._wake_receiver.poll(0):
                    self._wake_receiver.recv()
                while not self._queue.empty():
                    events = self._queue.get_nowait()
                    if events is None:
                        return
                    self._send(events)
            if self._replay in ready:
                snapshot = self._encoder.encode(KVEventBatch(time.time(), whole_cache(self._mirror, self.block_size)))
                while self._replay.poll(0):
                    self._answer_snapshot(self._replay.recv_multipart(), snapshot)

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
