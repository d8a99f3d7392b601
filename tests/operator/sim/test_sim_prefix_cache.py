"""The replicas' prefix cache: hits, LRU eviction, pinning, and the prefill a hit saves."""

from __future__ import annotations

import pytest

from kvpilot.operator.sim.cache import PrefixCache, block_id
from kvpilot.operator.sim.profile import Profile
from kvpilot.operator.sim.replica import Replica, Request

CONVERSATION = 7


def test_a_request_frees_its_blocks_and_the_next_turn_finds_them_from_the_first_on():
    cache = PrefixCache()
    cache.pin(CONVERSATION, 0, 0, 4)
    cache.release(CONVERSATION, 0, pinned=4, computed=6)  # the prompt's 4 blocks and the output's 2
    assert cache.leading(CONVERSATION, 0, 10) == 6
    assert cache.leading(CONVERSATION + 1, 0, 10) == 0


def test_the_least_recently_freed_go_first_and_a_conversation_loses_its_tail_first():
    cache = PrefixCache()
    for conversation in (1, 2):
        cache.pin(conversation, 0, 0, 3)
        cache.release(conversation, 0, pinned=3, computed=3)
    cache.trim(4)  # two of the six go: conversation 1's, freed first, from its last block
    assert (cache.leading(1, 0, 3), cache.leading(2, 0, 3)) == (1, 3)
    assert block_id(1, 0, 0) in cache.free and block_id(1, 0, 1) not in cache.free


def test_pinned_blocks_are_never_evicted_and_shared_ones_serve_every_conversation():
    cache = PrefixCache()
    shared = 2
    cache.pin(1, shared, 0, 4)  # blocks 0-1 shared, 2-3 conversation 1's
    cache.trim(0)
    assert len(cache) == 4
    cache.release(1, shared, pinned=4, computed=4)
    assert cache.leading(2, shared, 4) == 2  # another conversation: the system prompt's blocks
    cache.pin(2, shared, 0, 2)
    cache.trim(0)  # conversation 1's own go; the shared ones, in use, stay
    assert cache.leading(1, shared, 4) == 2 and len(cache) == 2


PROFILE = Profile("test", "made up", base_s=0.01, per_token_s=1e-3, per_context_token_s=0.0, num_gpu_blocks=64,
                  block_size=4)


class Ledger:
    def __init__(self) -> None:
        self.first: dict[int, float] = {}

    def first_token(self, request: Request, now: float) -> None:
        self.first[request.index] = now

    def finished(self, request: Request, now: float) -> None:
        pass

    def timed_out(self, request: Request, now: float) -> None:
        raise AssertionError("nothing times out here")


def serve(replica: Replica, request: Request) -> float:
    """Run `request` alone to its end; its TTFT."""
    when = replica.add(request, request.arrival)
    while when is not None:
        when = replica.advance(when)
    return replica.ledger.first[request.index] - request.arrival


def test_a_hit_prefills_only_the_tokens_after_the_cached_blocks():
    replica = Replica("r", PROFILE, max_num_seqs=8, max_num_batched_tokens=1024, timeout=1e9, ledger=Ledger())
    cold = serve(replica, Request(0, 0.0, 40, 8, 0, conversation=CONVERSATION))
    # Turn 2: turn 1's 40 prompt tokens and 8 output tokens (the last one's KV never computed: 47
    # tokens, 11 full blocks), then 12 tokens of its own.
    warm = serve(replica, Request(1, 100.0, 60, 8, 0, conversation=CONVERSATION))
    assert cold == pytest.approx(0.01 + 40e-3)
    assert warm == pytest.approx(0.01 + (60 - 44) * 1e-3)
    assert (replica.hit_tokens, replica.prompt_tokens) == (44, 100)


def test_a_prompt_held_whole_still_computes_its_last_token():
    replica = Replica("r", PROFILE, max_num_seqs=8, max_num_batched_tokens=1024, timeout=1e9, ledger=Ledger())
    serve(replica, Request(0, 0.0, 40, 2, 0, conversation=CONVERSATION))
    again = serve(replica, Request(1, 100.0, 40, 2, 0, conversation=CONVERSATION))
    assert again == pytest.approx(0.01 + 4e-3)  # 9 of its 10 blocks: the last block's tokens computed


def test_a_request_needing_the_room_evicts_the_tail_of_an_older_conversation_and_its_head_still_hits():
    small = Profile("small", "made up", base_s=0.01, per_token_s=1e-3, per_context_token_s=0.0, num_gpu_blocks=16,
                    block_size=4)
    replica = Replica("r", small, max_num_seqs=8, max_num_batched_tokens=1024, timeout=1e9, ledger=Ledger())
    serve(replica, Request(0, 0.0, 40, 2, 0, conversation=1))  # leaves its 10 full blocks cached
    serve(replica, Request(1, 10.0, 40, 2, 0, conversation=2))  # takes 11 of the 16: 5 of conversation 1's stay
    assert serve(replica, Request(2, 20.0, 44, 2, 0, conversation=1)) == pytest.approx(0.01 + (44 - 20) * 1e-3)
