"""Block pool and free queue: order, lazy eviction, the null block, usage and O(1) operations."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvpilot.runtime.core import block_pool
from kvpilot.runtime.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from kvpilot.runtime.core.hashing import extend_block_hashes
from kvpilot.runtime.request import Request, SamplingParams

BLOCK_SIZE = 4


def hashed_request(request_id: str, token_ids: list[int]) -> Request:
    request = Request(request_id, token_ids, SamplingParams(max_tokens=4))
    extend_block_hashes(request, BLOCK_SIZE)
    return request


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


# --- the free queue -----------------------------------------------------------------------------


def test_queue_pops_in_order_and_removes_from_the_middle() -> None:
    blocks = [KVCacheBlock(i) for i in range(1, 6)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 5

    queue.remove(blocks[2])
    queue.append(blocks[2])
    assert ids(queue.get_all_free_blocks()) == [1, 2, 4, 5, 3]
    assert queue.popleft().block_id == 1
    assert queue.num_free_blocks == 4
    assert ids(queue.get_all_free_blocks()) == [2, 4, 5, 3]


def test_queue_rejects_removing_an_unqueued_block_and_popping_when_empty() -> None:
    blocks = [KVCacheBlock(1), KVCacheBlock(2)]
    queue = FreeKVCacheBlockQueue(blocks)
    popped = queue.popleft()
    with pytest.raises(ValueError):
        queue.remove(popped)
    queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft()
    assert queue.num_free_blocks == 0


# --- the pool -----------------------------------------------------------------------------------


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    assert pool.null_block.block_id == 0
    assert pool.null_block not in pool.free_block_queue.get_all_free_blocks()

    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [1, 2, 3]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)

    pool.free_blocks(reversed(blocks))
    assert 0 not in ids(pool.get_new_blocks(3))


def test_get_new_blocks_beyond_free_count_raises_and_changes_nothing() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    pool.get_new_blocks(1)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert pool.get_num_free_blocks() == 2
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [2, 3]


def test_usage_is_used_over_usable_blocks() -> None:
    # Five blocks, one of them null: four usable, so each block is a quarter.
    pool = BlockPool(num_blocks=5, enable_caching=True)
    assert pool.get_usage() == 0.0
    first = pool.get_new_blocks(1)
    assert pool.get_usage() == 0.25
    rest = pool.get_new_blocks(3)
    assert pool.get_usage() == 1.0
    pool.free_blocks(rest[:2])
    assert pool.get_usage() == 0.5
    pool.free_blocks(first + rest[2:])
    assert pool.get_usage() == 0.0


def test_get_new_blocks_sets_ref_count_and_touch_free_count_references() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    [block] = pool.get_new_blocks(1)
    assert block.ref_cnt == 1
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.get_num_free_blocks() == 3
    assert pool.free_block_queue.get_all_free_blocks()[-1] is block

    # Touching a free block claims it back out of the queue.
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    assert block not in pool.free_block_queue.get_all_free_blocks()


def test_eviction_happens_only_when_a_cached_block_is_popped_from_the_head() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    request = hashed_request("r", list(range(16)))
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(request, blocks, num_cached_blocks=0, num_full_blocks=4)
    pool.free_blocks(reversed(blocks))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [4, 3, 2, 1]

    def cached_ids() -> list[int | None]:
        return [getattr(pool.get_cached_block(h), "block_id", None) for h in request.block_hashes]

    # Freed, yet every block is still findable: eviction is lazy.
    assert cached_ids() == [1, 2, 3, 4]

    # Popping the head evicts exactly that block.
    assert ids(pool.get_new_blocks(1)) == [4]
    assert cached_ids() == [1, 2, 3, None]
    assert blocks[3].block_hash is None

    # A cache hit on block 1 pulls it out of the queue's tail; it keeps its hash.
    pool.touch([blocks[0]])
    assert cached_ids() == [1, 2, 3, None]

    assert ids(pool.get_new_blocks(2)) == [3, 2]
    assert cached_ids() == [1, None, None, None]


def test_cache_full_blocks_keeps_the_first_mapping_for_a_duplicate_hash() -> None:
    pool = BlockPool(num_blocks=8, enable_caching=True)
    first = hashed_request("a", list(range(8)))
    second = hashed_request("b", list(range(8)))
    first_blocks = pool.get_new_blocks(2)
    second_blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(first, first_blocks, 0, 2)
    pool.cache_full_blocks(second, second_blocks, 0, 2)

    assert [pool.get_cached_block(h) for h in second.block_hashes] == first_blocks
    assert [block.block_hash for block in second_blocks] == [None, None]


def test_cache_full_blocks_caches_only_the_given_range() -> None:
    pool = BlockPool(num_blocks=8, enable_caching=True)
    request = hashed_request("a", list(range(12)))
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, blocks, num_cached_blocks=1, num_full_blocks=2)
    assert [block.block_hash for block in blocks] == [None, request.block_hashes[1], None]


def test_cache_full_blocks_does_nothing_with_caching_off() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=False)
    request = hashed_request("a", list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2)
    assert all(pool.get_cached_block(h) is None for h in request.block_hashes)


def test_reset_prefix_cache_refuses_while_blocks_are_in_use() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    request = hashed_request("a", list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2)

    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]

    pool.free_blocks(blocks[1:])
    assert pool.reset_prefix_cache() is False

    pool.free_blocks(blocks[:1])
    assert pool.reset_prefix_cache() is True
    assert all(pool.get_cached_block(h) is None for h in request.block_hashes)
    assert all(block.block_hash is None for block in blocks)


# --- O(1): count the free-queue nodes each operation visits -------------------------------------

_PREV = KVCacheBlock.prev_free_block
_NEXT = KVCacheBlock.next_free_block


class CountingBlock(KVCacheBlock):
    """A block that logs itself whenever its free-queue links are read or written."""

    __slots__ = ()
    log: list[KVCacheBlock] = []

    @property
    def prev_free_block(self) -> KVCacheBlock | None:
        CountingBlock.log.append(self)
        return _PREV.__get__(self)

    @prev_free_block.setter
    def prev_free_block(self, block: KVCacheBlock | None) -> None:
        CountingBlock.log.append(self)
        _PREV.__set__(self, block)

    @property
    def next_free_block(self) -> KVCacheBlock | None:
        CountingBlock.log.append(self)
        return _NEXT.__get__(self)

    @next_free_block.setter
    def next_free_block(self, block: KVCacheBlock | None) -> None:
        CountingBlock.log.append(self)
        _NEXT.__set__(self, block)


def link_accesses(operation: Callable[[], object]) -> tuple[int, int]:
    """(link reads and writes, distinct nodes visited) during one operation."""
    CountingBlock.log.clear()
    operation()
    return len(CountingBlock.log), len({id(block) for block in CountingBlock.log})


@pytest.fixture
def counting_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    # The queue's sentinels and the pool's blocks are built through this name, so all count.
    monkeypatch.setattr(block_pool, "KVCacheBlock", CountingBlock)


def queue_costs(num_blocks: int) -> list[tuple[int, int]]:
    blocks = [CountingBlock(i) for i in range(1, num_blocks + 1)]
    queue = FreeKVCacheBlockQueue(blocks)
    middle = blocks[num_blocks // 2]
    return [
        link_accesses(queue.popleft),
        link_accesses(lambda: queue.remove(middle)),
        link_accesses(lambda: queue.append(middle)),
    ]


def pool_costs(num_blocks: int) -> list[tuple[int, int]]:
    pool = BlockPool(num_blocks, enable_caching=True)
    middle = pool.blocks[num_blocks // 2]
    held: list[KVCacheBlock] = []
    return [
        link_accesses(lambda: held.extend(pool.get_new_blocks(1))),
        link_accesses(lambda: pool.touch([middle])),  # a cache hit on a free block
        link_accesses(lambda: pool.touch([middle])),  # already held: no queue work at all
        link_accesses(lambda: pool.free_blocks([middle])),  # still held once: no queue work
        link_accesses(lambda: pool.free_blocks([middle])),
        link_accesses(lambda: pool.free_blocks(held)),
    ]


@pytest.mark.usefixtures("counting_blocks")
def test_free_queue_operations_visit_a_constant_number_of_nodes() -> None:
    small, large = queue_costs(10), queue_costs(10_000)
    assert small == large
    # Nonzero: the links really are threaded through the blocks, not kept in a side list.
    for accesses, nodes in small:
        assert 0 < accesses <= 8 and nodes <= 4


@pytest.mark.usefixtures("counting_blocks")
def test_pool_touch_free_and_allocate_visit_a_constant_number_of_nodes() -> None:
    small, large = pool_costs(10), pool_costs(10_000)
    assert small == large
    pop, hit, rehit, partial_free, free, free_new = small
    assert rehit == partial_free == (0, 0)
    for accesses, nodes in (pop, hit, free, free_new):
        assert 0 < accesses <= 8 and nodes <= 4
