"""One replica's prefix cache as a router sees it: the block hashes its engine holds, kept current
from the engine's KV-cache events (runtime/core/kv_events.py has the wire format).

The index subscribes first, and waits for the batch the engine answers a subscription with: from
then on no batch can miss it. Then it asks the replay socket for a snapshot, applies it, and
applies the batches that follow it, dropping those the snapshot already covers. A sequence gap
(a batch lost to a slow subscriber, or a restarted engine counting from 0 again), a message it
cannot use, or a replay socket that does not answer each cost one log line and a new snapshot,
after a backoff that grows while nothing works.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import msgspec
import zmq
import zmq.asyncio

from kvpilot.runtime.core.hashing import BlockHash
from kvpilot.runtime.core.kv_events import (
    END_OF_REPLAY,
    BlockStored,
    KVEventBatch,
    apply_events,
    decode_seq,
    encode_seq,
)

logger = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT_S = 5.0
FIRST_RETRY_DELAY_S = 0.05
MAX_RETRY_DELAY_S = 10.0


class _LostSync(Exception):
    """Why the index no longer matches its replica; said in the one line logged for it."""


class ReplicaKVIndex:
    """Invariant: while `synced`, the hashes held are exactly the replica's cached hashes as of the
    last batch applied. While not, `prefix_blocks` answers 0: a stale answer would send requests to
    a replica for a prefix it may have evicted.

    Memory: one set of hashes, never more than the replica's cache holds, plus the batches that
    arrive while a snapshot is awaited (at most SNAPSHOT_TIMEOUT_S of them).
    """

    def __init__(self, name: str, publisher_url: str, replay_url: str, topic: str, block_size: int, *,
                 snapshot_timeout_s: float = SNAPSHOT_TIMEOUT_S) -> None:
        self.name = name
        self.publisher_url = publisher_url
        self.replay_url = replay_url
        self.topic = topic
        self.block_size = block_size
        self.snapshot_timeout_s = snapshot_timeout_s
        self.synced = False
        # Snapshots asked for after the first, and messages that could not be used.
        self.resnapshots = 0
        self.bad_messages = 0
        self._held: set[BlockHash] = set()
        self._last_seq = -1
        self._retry_delay_s = FIRST_RETRY_DELAY_S
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._context = zmq.asyncio.Context.instance()
        self._sockets: list[zmq.asyncio.Socket] = []
        self._task: asyncio.Task | None = None

    @property
    def num_blocks(self) -> int:
        """How many block hashes the index holds (0 while not synced)."""
        return len(self._held) if self.synced else 0

    def prefix_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """How many of the leading `hashes` the replica holds (0 while not synced)."""
        if not self.synced:
            return 0
        held = 0
        for block_hash in hashes:
            if block_hash not in self._held:
                break
            held += 1
        return held

    async def run(self) -> None:
        """Follow the replica until cancelled (or closed); raises nothing else."""
        self._task = asyncio.current_task()
        subscriber = self._socket(zmq.SUB, self.publisher_url)
        subscriber.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        try:
            # Not a batch in time (an engine down, or one that does not answer subscriptions): go on,
            # a batch missed meanwhile shows as a gap at the next one.
            await subscriber.poll(self.snapshot_timeout_s * 1000)
            while True:
                try:
                    await self._snapshot(subscriber)
                    await self._follow(subscriber)
                except (_LostSync, zmq.ZMQError) as lost:
                    self.synced = False
                    logger.warning("kv index %s: %s; resnapshotting in %.2f s", self.name, lost, self._retry_delay_s)
                except Exception:  # noqa: BLE001 - a bug here must cost this replica's routing hints, not the router
                    self.synced = False
                    logger.exception("kv index %s: failed; resnapshotting in %.2f s", self.name, self._retry_delay_s)
                await asyncio.sleep(self._retry_delay_s)
                self._retry_delay_s = min(2 * self._retry_delay_s, MAX_RETRY_DELAY_S)
                self.resnapshots += 1
        finally:
            self.synced = False
            self._close_sockets()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._close_sockets()

    async def _snapshot(self, subscriber: zmq.asyncio.Socket) -> None:
        """Bring the index to the replica's latest seq: the snapshot, then what arrived meanwhile."""
        replay = self._socket(zmq.DEALER, self.replay_url)
        try:
            # vLLM's request names the first seq wanted; kvpilot's engine sends the whole cache whatever it says.
            await replay.send_multipart([b"", encode_seq(0)])
            poller = zmq.asyncio.Poller()
            poller.register(subscriber, zmq.POLLIN)
            poller.register(replay, zmq.POLLIN)
            buffered: list[tuple[int, KVEventBatch]] = []
            deadline = asyncio.get_running_loop().time() + self.snapshot_timeout_s
            while True:
                remaining_s = deadline - asyncio.get_running_loop().time()
                ready = dict(await poller.poll(remaining_s * 1000)) if remaining_s > 0 else {}
                if not ready:
                    raise _LostSync(f"no snapshot from {self.replay_url} in {self.snapshot_timeout_s} s")
                if subscriber in ready:
                    while (frames := self._receive_now(subscriber)) is not None:
                        if (batch := self._decode(frames)) is not None:
                            buffered.append(batch)
                if replay in ready:
                    seq, snapshot = self._snapshot_reply(await replay.recv_multipart())
                    break
        finally:
            self._close(replay)
        self._held = set()
        apply_events(self._held, snapshot.events)
        self._last_seq = seq
        for seq, batch in buffered:
            if seq > self._last_seq:
                self._apply(seq, batch)
        self.synced = True

    async def _follow(self, subscriber: zmq.asyncio.Socket) -> None:
        while True:
            if (batch := self._decode(await subscriber.recv_multipart())) is not None:
                self._apply(*batch)
                self._retry_delay_s = FIRST_RETRY_DELAY_S

    def _apply(self, seq: int, batch: KVEventBatch) -> None:
        if seq != self._last_seq + 1:
            raise _LostSync(f"sequence gap: expected batch {self._last_seq + 1}, got {seq}")
        apply_events(self._held, batch.events)
        self._last_seq = seq

    def _decode(self, frames: list[bytes]) -> tuple[int, KVEventBatch] | None:
        """The batch and its seq; None for another topic that starts with ours (SUB matches prefixes)."""
        if len(frames) != 3:
            raise self._bad(f"a message of {len(frames)} frames (expected topic, seq, payload)")
        topic, seq, payload = frames
        if topic != self.topic.encode():
            return None
        return self._decoded(seq, payload)

    def _snapshot_reply(self, frames: list[bytes]) -> tuple[int, KVEventBatch]:
        if len(frames) != 3 or frames[0] != b"":
            raise self._bad(f"a snapshot reply of {len(frames)} frames (expected empty, seq, payload)")
        if frames[1] == END_OF_REPLAY:
            raise self._bad("an empty replay instead of a snapshot (a vLLM engine, which replays past batches?)")
        return self._decoded(frames[1], frames[2])

    def _decoded(self, seq: bytes, payload: bytes) -> tuple[int, KVEventBatch]:
        try:
            number, batch = decode_seq(seq), self._decoder.decode(payload)
        except (ValueError, msgspec.DecodeError) as err:
            raise self._bad(f"an undecodable batch ({err})") from None
        for event in batch.events:
            if isinstance(event, BlockStored) and event.block_size != self.block_size:
                # Hashes over blocks of another size never match the router's: every lookup would miss.
                raise self._bad(f"blocks of {event.block_size} tokens, where the router hashes {self.block_size}")
        return number, batch

    def _bad(self, what: str) -> _LostSync:
        self.bad_messages += 1
        return _LostSync(f"received {what}")

    @staticmethod
    def _receive_now(socket: zmq.asyncio.Socket) -> list[bytes] | None:
        try:
            return socket.recv_multipart(zmq.NOBLOCK).result()
        except zmq.Again:
            return None

    def _socket(self, kind: int, url: str) -> zmq.asyncio.Socket:
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(url)
        self._sockets.append(socket)
        return socket

    def _close(self, socket: zmq.asyncio.Socket) -> None:
        socket.close()
        self._sockets.remove(socket)

    def _close_sockets(self) -> None:
        for socket in self._sockets:
            socket.close()
        self._sockets.clear()
