"""KV-cache blocks, the free queue that orders them for reuse, and the prefix-cache hash map."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvpilot.runtime.core.hashing import BlockHash
from kvpilot.runtime.core.kv_events import KVEventLog

if TYPE_CHECKING:
    from kvpilot.runtime.request import Request


class KVCacheBlock:
    """One block of KV memory; the prev/next links belong to the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set only while the block is in the hash map, so a block never carries a stale hash.
        self.block_hash: BlockHash | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else ", cached"
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeKVCacheBlockQueue:
    """Free blocks, least recently freed first: a doubly linked list threaded through the blocks.

    Linking through the blocks themselves makes `remove` O(1) (a cache hit pulls a block out of
    the middle) and means no operation allocates. Sentinels at both ends remove the edge cases.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        chain = [self._head, *blocks, self._tail]
        for prev, nxt in zip(chain, chain[1:]):
            prev.next_free_block = nxt
            nxt.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free_block
        if first is self._tail:
            raise ValueError("no free blocks left")
        self.remove(first)
        return first

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        # Unlinked blocks have no links, which is how `remove` tells they are not queued.
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block from head to tail; O(n), for tests and debugging."""
        blocks = []
        block = self._head.next_free_block
        while block is not self._tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks


class BlockPool:
    """Owns every block: hands free ones out, counts references, and maps hashes to cached blocks.

    A freed block keeps its hash and stays findable until it is popped for reuse (lazy eviction),
    so the free queue's order is also the eviction order.

    With a `kv_events` log, every change to the hash map is recorded there too: hashes stored,
    evicted, and the whole map cleared (core/kv_events.py). Without one, recording costs one
    check per call, or per eviction.
    """

    def __init__(self, num_blocks: int, enable_caching: bool, kv_events: KVEventLog | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is null), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Block 0 pads block tables; it is kept out of the queue so it is never handed out.
        self.null_block = self.blocks[0]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.kv_events = kv_events

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, num: int) -> list[KVCacheBlock]:
        if num > self.get_num_free_blocks():
            raise ValueError(f"cannot allocate {num} blocks, {self.get_num_free_blocks()} free")
        blocks = []
        for _ in range(num):
            block = self.free_block_queue.popleft()
            self.evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def evict(self, block: KVCacheBlock) -> None:
        """Take the block out of the hash map, if it is there."""
        if block.block_hash is None:
            return
        del self.cached_block_hash_to_block[block.block_hash]
        if self.kv_events is not None:
            self.kv_events.removed(block.block_hash)
        block.block_hash = None

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            # A cached block nobody holds is still in the free queue: claiming it takes it out.
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block_hash = request.block_hashes[i]
            # Two requests can compute the same block at once; the first mapping wins and the
            # duplicate stays uncached, to be reused as an ordinary free block.
            if block_hash in self.cached_block_hash_to_block:
                continue
            blocks[i].block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = blocks[i]
        if self.kv_events is not None:
            # A duplicate skipped above is cached all the same (in the other request's block).
            parent = request.block_hashes[num_cached_blocks - 1] if num_cached_blocks > 0 else None
            lora = request.lora_request
            self.kv_events.stored(request.block_hashes[num_cached_blocks:num_full_blocks], parent,
                                  lora and lora.lora_int_id)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, e.g. after a weight update made the cached KV stale.

        Refused while any block is in use, so no running request keeps KV from before the reset.
        """
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.kv_events is not None:
            self.kv_events.cleared()
        return True

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)
