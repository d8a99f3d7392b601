"""The scheduler's only view of KV memory: per-request block lists on top of the block pool.

A request's blocks hold its tokens in order, `block_size` per block. Admitting a request is a
lookup then a claim: `get_computed_blocks` finds the longest run of its full blocks whose hashes
are cached, and `allocate_slots` takes those hits plus fresh blocks for the tokens to compute,
or nothing at all when they do not fit (the scheduler then preempts or stops admitting). Full
blocks are published to the hash map as soon as they are scheduled. `free` gives every block
back, tail first, and unpublishes any block the request never got to compute.

With `enable_kv_cache_events`, the pool records what it stores and evicts, and `take_kv_events`
hands the record over (core/kv_events.py).
"""

from __future__ import annotations

from kvpilot.runtime.core.block_pool import BlockPool, KVCacheBlock
from kvpilot.runtime.core.hashing import BlockHash, extend_block_hashes
from kvpilot.runtime.core.kv_events import KVCacheEvent, KVEventLog
from kvpilot.runtime.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 enable_kv_cache_events: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.kv_events = KVEventLog(block_size) if enable_kv_cache_events else None
        self.block_pool = BlockPool(num_blocks, enable_caching, self.kv_events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already in the hash map (or were skipped
        # as duplicates), so each step hashes only the blocks that became full since.
        self.num_cached_blocks: dict[str, int] = {}
        # Per request, the most tokens (computed plus new) its blocks hold with no block left to
        # allocate or hash: up to there `allocate_slots` has nothing to do, so the scheduler may skip
        # the call. Kept in step with the two maps above.
        self.num_tokens_without_allocation: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request, in whole blocks, and its length in tokens.

        A pure lookup: nothing is claimed until `allocate_slots` succeeds.
        """
        # Cached positions never went through the model, so they would have no prompt logprobs.
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        extend_block_hashes(request, self.block_size)
        # The last token must be computed to get logits, so a full hit is cut back by a block.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for the request's computed, newly hit and new tokens.

        Returns the newly allocated blocks, or None, with nothing changed, when they do not fit.
        """
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        # The common step of a running request: its tokens still fit the blocks it holds, and no
        # block has become full since it was last published, so there is nothing to allocate or hash.
        if not new_computed_blocks and num_tokens <= self.num_tokens_without_allocation.get(request.request_id, -1):
            return []
        req_blocks = self.req_to_blocks.get(request.request_id)
        new_computed_blocks = new_computed_blocks or []
        if req_blocks is None:
            req_blocks = []
        num_required = -(-num_tokens // self.block_size)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(new_computed_blocks))
        # Hit blocks that nobody holds sit in the free queue: claiming them uses up free blocks.
        num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks + num_evictable_hits > self.block_pool.get_num_free_blocks():
            return None

        # Claim the hits before popping new blocks, or a pop could evict one of them.
        self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        if request.request_id not in self.req_to_blocks:
            self.req_to_blocks[request.request_id] = req_blocks
            # Hit blocks are in the hash map already.
            self.num_cached_blocks[request.request_id] = len(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        req_blocks.extend(new_blocks)

        if request.num_computed_tokens == 0:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_new_computed_tokens
        capacity = len(req_blocks) * self.block_size
        if self.enable_caching:
            self._cache_full_blocks(request, req_blocks, num_tokens)
            # One token short of filling the first block not published yet.
            capacity = min(capacity, (self.num_cached_blocks[request.request_id] + 1) * self.block_size - 1)
        self.num_tokens_without_allocation[request.request_id] = capacity
        return new_blocks

    def _cache_full_blocks(
        self, request: Request, req_blocks: list[KVCacheBlock], num_tokens: int
    ) -> None:
        # Blocks are published when scheduled, not after the forward pass: a hit in this same
        # step is still safe, as the runner writes each layer's KV before attention reads it.
        extend_block_hashes(request, self.block_size)
        num_cached = self.num_cached_blocks[request.request_id]
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(request, req_blocks, num_cached, num_full)
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks is None:
            return
        del self.num_cached_blocks[request.request_id]
        del self.num_tokens_without_allocation[request.request_id]
        # Blocks are published when scheduled. A request preempted in the step that scheduled
        # them never computed them: past its computed prefix, nothing may stay findable.
        for block in blocks[request.num_computed_tokens // self.block_size:]:
            self.block_pool.evict(block)
        # Reversed, so the request's tail blocks, the least likely to be shared, go first.
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def take_kv_events(self) -> list[KVCacheEvent]:
        """What the pool stored, evicted and cleared since the last call; [] with events off."""
        return [] if self.kv_events is None else self.kv_events.drain()

    def cached_block_hashes(self) -> list[BlockHash]:
        return list(self.block_pool.cached_block_hash_to_block)
