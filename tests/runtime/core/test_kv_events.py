"""The block pool's record of KV-cache events: stores, lazy evictions and resets, in order, such
that applying them reproduces the hash map; and nothing recorded without a log."""

from __future__ import annotations

import msgspec

from kvpilot.runtime.core.block_pool import BlockPool
from kvpilot.runtime.core.hashing import extend_block_hashes
from kvpilot.runtime.core.kv_cache_manager import KVCacheManager
from kvpilot.runtime.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventLog,
    apply_events,
)
from kvpilot.runtime.lora.request import LoRARequest
from kvpilot.runtime.request import Request, SamplingParams

BLOCK_SIZE = 4


def request(request_id: str, token_ids: list[int], cache_salt: str | None = None) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_tokens=4), cache_salt=cache_salt)


def admit(manager: KVCacheManager, req: Request) -> None:
    hits, num_hit_tokens = manager.get_computed_blocks(req)
    assert manager.allocate_slots(req, req.num_tokens - num_hit_tokens, hits, num_hit_tokens) is not None
    req.num_computed_tokens = req.num_tokens


def cached(manager: KVCacheManager) -> set[bytes]:
    return set(manager.block_pool.cached_block_hash_to_block)


def test_stored_blocks_are_recorded_as_one_chain_with_their_parent() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_kv_cache_events=True)
    req = request("a", list(range(10)), cache_salt="tenant-a")
    admit(manager, req)
    assert manager.take_kv_events() == [BlockStored(req.block_hashes[:2], None, [], BLOCK_SIZE)]
    # Decoding fills the third block: it is stored with the second as its parent.
    for token_id in (10, 11):
        req.append_output_token_id(token_id)
    manager.allocate_slots(req, 2)
    assert manager.take_kv_events() == [BlockStored([req.block_hashes[2]], req.block_hashes[1], [], BLOCK_SIZE)]
    assert manager.take_kv_events() == []


def test_an_adapters_blocks_are_stored_with_its_lora_id() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_kv_cache_events=True)
    req = Request("a", list(range(8)), SamplingParams(max_tokens=4), lora_request=LoRARequest("sql", 7, "/sql"))
    admit(manager, req)
    assert manager.take_kv_events() == [BlockStored(req.block_hashes[:2], None, [], BLOCK_SIZE, lora_id=7)]


def test_eviction_is_recorded_when_a_cached_block_is_popped_for_reuse() -> None:
    manager = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE, enable_kv_cache_events=True)
    first = request("a", list(range(8)))
    admit(manager, first)
    manager.free(first)
    held = set()
    apply_events(held, manager.take_kv_events())
    # Freeing is not evicting: the blocks stay findable until they are reused.
    assert held == cached(manager) == set(first.block_hashes)

    admit(manager, request("b", list(range(100, 108))))
    events = manager.take_kv_events()
    # Both evictions of the allocation travel as one event, before the new blocks are stored.
    assert events[0] == BlockRemoved(first.block_hashes[::-1])
    apply_events(held, events)
    assert held == cached(manager) and not held & set(first.block_hashes)


def test_a_preempted_request_unpublishes_the_blocks_it_never_computed() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_kv_cache_events=True)
    req = request("a", list(range(12)))
    manager.allocate_slots(req, req.num_tokens)
    req.num_computed_tokens = 4
    manager.free(req)
    held = set()
    apply_events(held, manager.take_kv_events())
    assert held == cached(manager) == {req.block_hashes[0]}


def test_a_reset_is_recorded_as_a_clear_that_replaces_what_came_before() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_kv_cache_events=True)
    req = request("a", list(range(8)))
    admit(manager, req)
    manager.free(req)
    assert manager.reset_prefix_cache()
    assert manager.take_kv_events() == [AllBlocksCleared()]


def test_two_requests_filling_the_same_block_announce_it_twice_and_evict_it_once() -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE, enable_kv_cache_events=True)
    twins = [request(name, list(range(4))) for name in ("a", "b")]
    for req in twins:
        # Scheduled in the same step: neither sees the other's block as a hit.
        manager.allocate_slots(req, req.num_tokens)
    held = set()
    apply_events(held, manager.take_kv_events())
    assert held == cached(manager)
    for req in twins:
        manager.free(req)
    admit(manager, request("c", list(range(50, 66))))
    apply_events(held, manager.take_kv_events())
    assert held == cached(manager)


def test_without_a_log_nothing_is_recorded() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    admit(manager, request("a", list(range(8))))
    assert manager.block_pool.kv_events is None
    assert manager.take_kv_events() == []


def test_a_pool_with_a_log_records_what_its_hash_map_does() -> None:
    log = KVEventLog(BLOCK_SIZE)
    pool = BlockPool(num_blocks=4, enable_caching=True, kv_events=log)
    req = request("a", list(range(8)))
    extend_block_hashes(req, BLOCK_SIZE)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2)
    pool.free_blocks(blocks)
    pool.get_new_blocks(3)
    assert log.drain() == [BlockStored(req.block_hashes, None, [], BLOCK_SIZE), BlockRemoved(req.block_hashes)]


def test_the_wire_shape_is_vllms_tagged_arrays() -> None:
    batch = KVEventBatch(1.5, [BlockStored([b"h1", b"h2"], None, [], 16), BlockRemoved([b"h1"]), AllBlocksCleared()])
    encoded = msgspec.msgpack.encode(batch)
    assert msgspec.msgpack.decode(encoded) == [
        1.5,
        [["BlockStored", [b"h1", b"h2"], None, [], 16, None, None], ["BlockRemoved", [b"h1"], None],
         ["AllBlocksCleared"]],
        None,
    ]
    assert msgspec.msgpack.decode(encoded, type=KVEventBatch) == batch
