"""The adapter slots the scheduler hands out, the host caches that mirror each other, and the
scheduler passing over a request whose adapter has no slot (without blocking those behind it)."""

from __future__ import annotations

import pytest

from kvpilot.runtime.config import SchedulerConfig
from kvpilot.runtime.core.hashing import hash_blocks
from kvpilot.runtime.core.kv_cache_manager import KVCacheManager
from kvpilot.runtime.core.sched.scheduler import Scheduler
from kvpilot.runtime.lora.host_cache import AdapterLRU
from kvpilot.runtime.lora.request import LoRARequest
from kvpilot.runtime.lora.slots import LoRAAssignment, LoRASlots
from kvpilot.runtime.request import Request, RequestStatus, SamplingParams

A, B, C = (LoRARequest(name, index, f"/adapters/{name}") for index, name in enumerate("abc", start=1))


def test_requests_of_one_adapter_share_its_slot():
    slots = LoRASlots(2)
    assert slots.acquire("r1", A) == slots.acquire("r2", A) == 0
    assert slots.acquire("r3", B) == 1
    slots.acquire("r4", A)
    assert slots.take_assignments() == [LoRAAssignment(0, A), LoRAAssignment(1, B), LoRAAssignment(0, A)]
    assert slots.take_assignments() == []
    assert slots.running_adapters() == ["a", "b"]


def test_a_slot_in_use_is_never_given_away_and_a_failed_acquire_changes_nothing():
    slots = LoRASlots(1)
    slots.acquire("r1", A)
    slots.take_assignments()
    assert not slots.can_acquire(B)
    assert slots.acquire("r2", B) is None
    assert slots.take_assignments() == [] and slots.running_adapters() == ["a"]
    slots.release("r1")
    assert slots.acquire("r2", B) == 0
    assert slots.take_assignments() == [LoRAAssignment(0, B)]


def test_an_idle_adapter_stays_in_its_slot_until_the_slot_is_needed_idle_longest_first():
    slots = LoRASlots(2)
    slots.acquire("r1", A)
    slots.acquire("r2", B)
    slots.release("r2")
    slots.release("r1")
    slots.take_assignments()
    # Back to the slot it still holds (the workers find it there: nothing to copy).
    assert slots.acquire("r3", B) == 1 and slots.take_assignments() == [LoRAAssignment(1, B)]
    slots.release("r3")
    # A has been idle longest: C takes its slot.
    assert slots.acquire("r4", C) == 0
    assert slots.take_assignments() == [LoRAAssignment(0, C)]


def test_the_host_cache_evicts_the_least_recently_used_and_a_failed_load_changes_nothing():
    cache = AdapterLRU(2)
    loads = []
    load = lambda lora: loads.append(lora.lora_name) or lora.lora_name.upper()  # noqa: E731
    assert cache.use(A, load) == "A"
    cache.use(B, load)
    cache.use(A, load)
    cache.use(C, load)
    assert [lora.lora_name for lora in cache.loaded()] == ["a", "c"] and loads == ["a", "b", "c"]

    def broken(lora):
        raise ValueError("corrupt")

    with pytest.raises(ValueError):
        cache.use(B, broken)
    assert [lora.lora_name for lora in cache.loaded()] == ["a", "c"]


def test_an_adapter_keys_the_block_hashes():
    tokens = list(range(8))
    base = hash_blocks(tokens, 4, None)
    assert hash_blocks(tokens, 4, None, lora_int_id=None) == base
    with_a, with_b = hash_blocks(tokens, 4, None, lora_int_id=1), hash_blocks(tokens, 4, None, lora_int_id=2)
    assert len({base[0], with_a[0], with_b[0]}) == 3 and len({base[1], with_a[1], with_b[1]}) == 3
    assert hash_blocks(tokens, 4, "salt", lora_int_id=1) != with_a


def request(req_id: str, lora: LoRARequest | None) -> Request:
    return Request(req_id, [1, 2, 3, 4], SamplingParams(max_tokens=4), lora_request=lora)


def test_a_request_whose_adapter_has_no_slot_waits_without_blocking_the_others():
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64),
                          KVCacheManager(32, 4, enable_caching=True), LoRASlots(1))
    for req_id, lora in [("a1", A), ("b1", B), ("base", None), ("a2", A)]:
        scheduler.add_request(request(req_id, lora))
    output = scheduler.schedule()
    assert [new.req_id for new in output.scheduled_new_reqs] == ["a1", "base", "a2"]
    assert [new.lora_slot for new in output.scheduled_new_reqs] == [0, -1, 0]
    assert output.lora_assignments == [LoRAAssignment(0, A)]
    # b1 kept its place at the head, and runs once no running request uses the slot.
    assert [r.request_id for r in scheduler.waiting] == ["b1"]
    assert scheduler.waiting_lora_adapters() == ["b"] and scheduler.running_lora_adapters() == ["a"]
    scheduler.finish_requests(["a1"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.schedule().scheduled_new_reqs == []
    scheduler.finish_requests(["a2"], RequestStatus.FINISHED_ABORTED)
    output = scheduler.schedule()
    assert [new.req_id for new in output.scheduled_new_reqs] == ["b1"]
    assert output.lora_assignments == [LoRAAssignment(0, B)]
