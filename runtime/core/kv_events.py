"""KV-cache events: what the block pool records, and their wire format (vLLM's, which llm-d's and
production-stack's KV indexers already decode).

A batch travels as a multipart message `[topic, seq, payload]`: seq is 8 bytes big-endian and
grows by one per batch from 0, the engine's first batch; payload is a msgpack `KVEventBatch` of
tagged, array-like Structs (`["BlockStored", [hash, ...], parent, [], block_size, None, None]`).
A hash is the engine's sha256 block hash (core/hashing.py), salted per tenant. `token_ids` is
always empty: a tenant's tokens never leave the engine, and a router computes the same hashes.

Whoever applies every batch in order, from a snapshot on, holds exactly the engine's cached
hashes. Storing a hash that is already held changes nothing: two requests that fill the same
block in one step announce it twice, and it is evicted once.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from kvpilot.runtime.core.hashing import BlockHash

# What a replay reply ends with, where a seq would be; vLLM's marker.
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class KVCacheEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    """One change to the set of cached block hashes."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    # The hash of the block before the first one (None: the first is a prompt's first block).
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def whole_cache(block_hashes: Iterable[BlockHash], block_size: int) -> list[KVCacheEvent]:
    """Events that bring any holder to exactly `block_hashes`, whatever it held before."""
    return [AllBlocksCleared(), BlockStored(list(block_hashes), None, [], block_size)]


def apply_events(held: set[BlockHash], events: Iterable[KVCacheEvent]) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            held.difference_update(event.block_hashes)
        else:
            held.clear()


class KVEventLog:
    """The block pool's changes since the last `drain`, in the order they happened.

    Invariant: applying the drained events, in order, to the hashes cached at the previous drain
    gives the hashes cached now.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []

    def stored(self, block_hashes: list[BlockHash], parent: BlockHash | None, lora_id: int | None = None) -> None:
        """`lora_id`: the LoRA adapter whose KV the blocks hold (vLLM's field), None for the base model."""
        self._events.append(BlockStored(block_hashes, parent, [], self.block_size, lora_id))

    def removed(self, block_hash: BlockHash) -> None:
        # Blocks are evicted one at a time, usually many in a row: one event carries the run.
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved([block_hash]))

    def cleared(self) -> None:
        # Whatever came before a clear no longer matters to anyone.
        self._events = [AllBlocksCleared()]

    def drain(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
