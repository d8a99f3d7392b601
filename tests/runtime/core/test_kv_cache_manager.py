"""KV-cache manager: prefix hits, sharing, salts, all-or-nothing allocation and stats; hashing."""

from __future__ import annotations

import pytest

from kvpilot.runtime.core.hashing import extend_block_hashes, hash_block_tokens
from kvpilot.runtime.core.kv_cache_manager import KVCacheManager
from kvpilot.runtime.request import Request, SamplingParams

BLOCK_SIZE = 4


def make_request(
    request_id: str,
    token_ids: list[int],
    cache_salt: str | None = None,
    prompt_logprobs: int | None = None,
) -> Request:
    params = SamplingParams(max_tokens=16, prompt_logprobs=prompt_logprobs)
    return Request(request_id, token_ids, params, cache_salt=cache_salt)


def admit(manager: KVCacheManager, request: Request) -> int:
    """Schedule the whole prompt as the scheduler would; returns the prefix-hit tokens."""
    computed, num_hit_tokens = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(
        request, request.num_tokens - num_hit_tokens, computed, num_hit_tokens
    )
    assert new_blocks is not None
    request.num_computed_tokens = request.num_tokens
    return num_hit_tokens


def free_order(manager: KVCacheManager) -> list[int]:
    return [block.block_id for block in manager.block_pool.free_block_queue.get_all_free_blocks()]


def ref_counts(manager: KVCacheManager, block_ids: list[int]) -> list[int]:
    return [manager.block_pool.blocks[i].ref_cnt for i in block_ids]


# --- free-queue order ---------------------------------------------------------------------------


def test_free_queue_order_after_allocate_free_and_hit() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(10)))
    b = make_request("b", list(range(100, 106)))
    c = make_request("c", list(range(8)) + [200, 201, 202])

    # Start:                    [1 2 3 4 5 6 7]      (block 0 is null, never queued)
    # a: 10 tokens, 3 blocks popped from the head: 1 2 3; 1 and 2 are full and cached.
    #                           [4 5 6 7]
    # b: 6 tokens, pops 4 5; 4 is full and cached.
    #                           [6 7]
    # free a: reversed, 3 2 1 join the tail, so a's partial tail block goes first.
    #                           [6 7 3 2 1]
    # free b: reversed, 5 4.    [6 7 3 2 1 5 4]
    # c: shares a's first 8 tokens, hits 1 2, which leave the middle of the queue; it needs
    #    one more block for its 3 last tokens and pops 6.
    #                           [7 3 5 4]
    # free c: reversed, 6 2 1.  [7 3 5 4 6 2 1]
    admit(manager, a)
    assert manager.get_block_ids("a") == [1, 2, 3]
    admit(manager, b)
    assert manager.get_block_ids("b") == [4, 5]
    manager.free(a)
    manager.free(b)
    assert free_order(manager) == [6, 7, 3, 2, 1, 5, 4]

    assert admit(manager, c) == 8
    assert manager.get_block_ids("c") == [1, 2, 6]
    assert free_order(manager) == [7, 3, 5, 4]

    manager.free(c)
    assert free_order(manager) == [7, 3, 5, 4, 6, 2, 1]
    # Freed but not popped: a's and b's full blocks are all still hits.
    assert manager.get_computed_blocks(make_request("a2", list(range(10))))[1] == 8
    assert manager.get_computed_blocks(make_request("b2", list(range(100, 106))))[1] == 4


# --- sharing and ref counts ---------------------------------------------------------------------


def test_shared_prefix_blocks_are_reference_counted() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(10)))
    b = make_request("b", list(range(8)) + [100, 101, 102])
    admit(manager, a)
    assert admit(manager, b) == 8

    assert manager.get_block_ids("a") == [1, 2, 3]
    assert manager.get_block_ids("b") == [1, 2, 4]
    assert ref_counts(manager, [1, 2, 3, 4]) == [2, 2, 1, 1]

    manager.free(a)
    assert ref_counts(manager, [1, 2, 3, 4]) == [1, 1, 0, 1]
    assert free_order(manager) == [5, 6, 7, 3]

    manager.free(b)
    assert ref_counts(manager, [1, 2, 3, 4]) == [0, 0, 0, 0]
    assert free_order(manager) == [5, 6, 7, 3, 4, 2, 1]


def test_hits_on_blocks_another_request_holds_take_no_free_blocks() -> None:
    # Four usable blocks; a holds three, so one is free.
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(12)))
    admit(manager, a)
    assert manager.num_free_blocks == 1

    # b hits a's two first blocks (held, so free of charge) and needs one new block.
    b = make_request("b", list(range(8)) + [100, 101, 102, 103])
    assert admit(manager, b) == 8
    assert manager.num_free_blocks == 0
    assert manager.get_block_ids("b") == [1, 2, 4]


# --- salts --------------------------------------------------------------------------------------


def test_different_salts_never_share_blocks_and_the_same_salt_does() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    prompt = list(range(13))
    admit(manager, make_request("t1-a", prompt, cache_salt="tenant-1"))

    other_tenant = make_request("t2", prompt, cache_salt="tenant-2")
    unsalted = make_request("none", prompt)
    same_tenant = make_request("t1-b", prompt, cache_salt="tenant-1")
    assert manager.get_computed_blocks(other_tenant) == ([], 0)
    assert manager.get_computed_blocks(unsalted) == ([], 0)
    assert manager.get_computed_blocks(same_tenant)[1] == 12


def test_salt_changes_every_block_hash() -> None:
    salted = make_request("a", list(range(12)), cache_salt="s")
    plain = make_request("b", list(range(12)))
    extend_block_hashes(salted, BLOCK_SIZE)
    extend_block_hashes(plain, BLOCK_SIZE)
    assert len(salted.block_hashes) == 3
    assert all(x != y for x, y in zip(salted.block_hashes, plain.block_hashes))


# --- hit length ---------------------------------------------------------------------------------


def test_hit_on_a_fully_cached_prompt_leaves_the_last_block_to_compute() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    admit(manager, make_request("a", list(range(8))))

    blocks, num_tokens = manager.get_computed_blocks(make_request("b", list(range(8))))
    assert num_tokens == 4
    assert [block.block_id for block in blocks] == [1]

    # One token past the blocks: the cap is then above both blocks.
    _, num_tokens = manager.get_computed_blocks(make_request("c", list(range(9))))
    assert num_tokens == 8


def test_hit_stops_at_the_first_miss() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    admit(manager, make_request("a", list(range(13))))
    diverging = list(range(4)) + [99] + list(range(5, 13))
    assert manager.get_computed_blocks(make_request("b", diverging))[1] == 4


def test_no_hits_with_caching_off_or_prompt_logprobs() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    admit(manager, make_request("a", list(range(9))))
    with_logprobs = make_request("b", list(range(9)), prompt_logprobs=0)
    assert manager.get_computed_blocks(with_logprobs) == ([], 0)

    off = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_caching=False)
    admit(off, make_request("a", list(range(9))))
    assert off.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert all(block.block_hash is None for block in off.block_pool.blocks)


def test_get_computed_blocks_is_a_pure_lookup() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(9)))
    admit(manager, a)
    manager.free(a)
    before = (free_order(manager), manager.prefix_cache_queries, manager.prefix_cache_hits)

    blocks, _ = manager.get_computed_blocks(make_request("b", list(range(9))))
    assert [block.ref_cnt for block in blocks] == [0, 0]
    assert (free_order(manager), manager.prefix_cache_queries, manager.prefix_cache_hits) == before


# --- allocation ---------------------------------------------------------------------------------


def test_failed_allocation_changes_nothing() -> None:
    # Four usable blocks. a leaves three cached blocks behind, all free.
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(12)))
    admit(manager, a)
    manager.free(a)
    queries, hits = manager.prefix_cache_queries, manager.prefix_cache_hits

    # b: 20 tokens, 5 blocks. It hits a's first two, but those are free blocks too: 2 claimed
    # + 3 new = 5 > 4 free. Counting only the 3 new blocks would wrongly say it fits.
    b = make_request("b", list(range(8)) + list(range(100, 112)))
    computed, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 8
    order = free_order(manager)
    assert manager.allocate_slots(b, 12, computed, num_hit_tokens) is None

    assert manager.num_free_blocks == 4
    assert free_order(manager) == order
    assert [block.ref_cnt for block in computed] == [0, 0]
    assert manager.get_block_ids("b") == []
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (queries, hits)
    assert all(manager.block_pool.get_cached_block(h) is not None for h in a.block_hashes)

    # 16 tokens fit exactly: 2 claimed + 2 new.
    c = make_request("c", list(range(8)) + list(range(100, 108)))
    assert admit(manager, c) == 8
    assert manager.num_free_blocks == 0


def test_hits_at_the_head_of_the_free_queue_are_claimed_before_popping_new_blocks() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(9)))
    admit(manager, a)
    manager.free(a)
    b = make_request("b", list(range(100, 112)))
    admit(manager, b)
    manager.free(b)
    # a's cached blocks 2 and 1 now lead the queue, where popping would evict them.
    assert free_order(manager) == [2, 1, 3, 5, 4]

    c = make_request("c", list(range(8)) + [200])
    assert admit(manager, c) == 8
    assert manager.get_block_ids("c") == [1, 2, 3]
    assert ref_counts(manager, [1, 2, 3]) == [1, 1, 1]
    assert manager.get_computed_blocks(make_request("d", list(range(9))))[1] == 8


def test_decode_grows_the_block_list_one_block_at_a_time() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(7)))
    admit(manager, a)
    assert manager.get_block_ids("a") == [1, 2]

    for token, expected_new in [(7, []), (8, [3]), (9, []), (10, []), (11, []), (12, [4])]:
        a.append_output_token_id(token)
        new_blocks = manager.allocate_slots(a, 1)
        assert [block.block_id for block in new_blocks] == expected_new
        a.num_computed_tokens += 1
    assert manager.get_block_ids("a") == [1, 2, 3, 4]


def test_chunked_prefill_caches_blocks_as_they_fill() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(12)))
    manager.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    # Only the first block is full so far.
    assert manager.get_computed_blocks(make_request("b", list(range(13))))[1] == 4

    manager.allocate_slots(a, 6)
    a.num_computed_tokens = 12
    assert manager.get_computed_blocks(make_request("c", list(range(13))))[1] == 12


def test_preempted_request_finds_its_own_blocks_including_output_tokens() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(6)))
    admit(manager, a)
    for token in (6, 7, 8):
        a.append_output_token_id(token)
        manager.allocate_slots(a, 1)
        a.num_computed_tokens += 1

    # Preemption: blocks go back and everything is recomputed, less what the cache still holds.
    manager.free(a)
    a.num_computed_tokens = 0
    assert manager.get_block_ids("a") == []
    assert admit(manager, a) == 8


def test_free_of_an_unknown_request_is_a_no_op() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(5)))
    manager.free(a)
    admit(manager, a)
    manager.free(a)
    manager.free(a)
    assert manager.num_free_blocks == 3
    assert ref_counts(manager, [1, 2]) == [0, 0]


# --- stats, usage, reset ------------------------------------------------------------------------


def test_prefix_cache_stats_count_admissions_only() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(10)))
    admit(manager, a)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (10, 0)

    # A decode step is not a query.
    a.append_output_token_id(10)
    manager.allocate_slots(a, 1)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (10, 0)

    admit(manager, make_request("b", list(range(9))))
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (19, 8)


def test_usage_and_free_count_follow_the_pool() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    assert manager.usage == 0.0
    a = make_request("a", list(range(5)))
    admit(manager, a)
    assert manager.num_free_blocks == 2
    assert manager.usage == 0.5
    manager.free(a)
    assert manager.usage == 0.0


def test_reset_prefix_cache_refuses_while_a_request_holds_blocks() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(9)))
    admit(manager, a)
    assert manager.reset_prefix_cache() is False
    assert manager.get_computed_blocks(make_request("b", list(range(9))))[1] == 8

    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request("c", list(range(9)))) == ([], 0)


# --- hashing ------------------------------------------------------------------------------------


def test_block_hash_is_deterministic_and_distinguishes_its_inputs() -> None:
    root = hash_block_tokens(None, [1, 2, 3, 4], None)
    assert root == hash_block_tokens(None, (1, 2, 3, 4), None)
    assert len(root) == 32

    variants = [
        root,
        hash_block_tokens(None, [12, 3, 4], None),
        hash_block_tokens(None, [1, 2, 3, 4], ()),
        hash_block_tokens(None, [1, 2, 3, 4], ("",)),
        hash_block_tokens(None, [1, 2, 3, 4], ("a",)),
        hash_block_tokens(root, [1, 2, 3, 4], None),
        hash_block_tokens(hash_block_tokens(None, [0], None), [1, 2, 3, 4], None),
    ]
    assert len(set(variants)) == len(variants)


def test_extend_block_hashes_chains_full_blocks_only_and_is_incremental() -> None:
    request = make_request("a", list(range(6)), cache_salt="s")
    extend_block_hashes(request, BLOCK_SIZE)
    first = hash_block_tokens(None, [0, 1, 2, 3], ("s",))
    assert request.block_hashes == [first]

    for token in (6, 7, 8):
        request.append_output_token_id(token)
    extend_block_hashes(request, BLOCK_SIZE)
    assert request.block_hashes == [first, hash_block_tokens(first, [4, 5, 6, 7], None)]


def test_unhashable_extra_keys_are_rejected() -> None:
    with pytest.raises(TypeError):
        hash_block_tokens(None, [1], (object(),))


def test_blocks_scheduled_but_never_computed_do_not_stay_in_the_cache() -> None:
    # A priority victim can be preempted in the very step that scheduled (and published) its
    # blocks; the runner never writes their KV, so no later request may hit them.
    manager = KVCacheManager(num_blocks=10, block_size=4)
    victim = Request("victim", list(range(10)), SamplingParams(max_tokens=4))
    manager.allocate_slots(victim, 10)
    manager.free(victim)
    assert manager.get_computed_blocks(Request("next", list(range(10)), SamplingParams(max_tokens=4))) == ([], 0)

    finished = Request("done", list(range(10)), SamplingParams(max_tokens=4))
    manager.allocate_slots(finished, 10)
    finished.num_computed_tokens = 10
    manager.free(finished)
    blocks, hit = manager.get_computed_blocks(Request("after", list(range(10)), SamplingParams(max_tokens=4)))
    assert hit == 8 and len(blocks) == 2


@pytest.mark.parametrize("enable_caching", [True, False])
def test_up_to_its_token_count_without_allocation_allocate_slots_has_nothing_to_do(enable_caching) -> None:
    # The scheduler skips allocate_slots up to this count, so past it there must be work (a block
    # to allocate or one to hash) and up to it none: checked against a manager that never skips.
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, enable_caching=enable_caching)
    a = make_request("a", list(range(6)))
    admit(manager, a)
    for token in range(6, 30):
        a.append_output_token_id(token)
        limit = manager.num_tokens_without_allocation["a"]
        blocks_before = manager.get_block_ids("a")
        cached_before = manager.num_cached_blocks["a"]
        new_blocks = manager.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        changed = manager.get_block_ids("a") != blocks_before or manager.num_cached_blocks["a"] != cached_before
        assert changed == (a.num_computed_tokens > limit), (token, limit)
        assert new_blocks == [] or a.num_computed_tokens > limit
    manager.free(a)
    assert "a" not in manager.num_tokens_without_allocation
