"""The scheduler's side of grammars (pure, no model): a request waits while its grammar compiles
and keeps its place; the others go ahead; a grammar that completes ends its request."""

from __future__ import annotations

import pytest

from kvpilot.runtime.config import SchedulerConfig
from kvpilot.runtime.core.kv_cache_manager import KVCacheManager
from kvpilot.runtime.core.sched.output import ModelRunnerOutput
from kvpilot.runtime.core.sched.scheduler import Scheduler
from kvpilot.runtime.request import Request, RequestStatus, SamplingParams


class FakeGrammar:
    """Compiles when the test says; accepts every token; complete after `length` tokens."""

    def __init__(self, length: int = 100) -> None:
        self.is_ready = False
        self.length = length
        self.accepted: list[int] = []

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)

    @property
    def is_finished(self) -> bool:
        return len(self.accepted) >= self.length


def request(req_id: str, grammar: FakeGrammar | None = None, arrival: float = 0.0) -> Request:
    r = Request(req_id, [1, 2, 3], SamplingParams(max_tokens=8), arrival_time=arrival)
    if grammar is not None:
        r.structured_output_request = grammar
        r.status = RequestStatus.WAITING_FOR_FSM
    return r


@pytest.fixture(params=["fcfs", "priority"])
def scheduler(request) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, policy=request.param)
    return Scheduler(config, KVCacheManager(32, 4, False))


def step(scheduler: Scheduler, token: int = 9):
    out = scheduler.schedule()
    req_ids = list(out.num_scheduled_tokens)
    scheduler.update_from_output(out, ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[token]] * len(req_ids),
                                                        logprobs=[None] * len(req_ids)))
    return out


def test_a_compiling_request_keeps_its_place_while_others_go_ahead(scheduler):
    grammar = FakeGrammar()
    scheduler.add_request(request("g", grammar, arrival=0.0))
    scheduler.add_request(request("a", arrival=1.0))
    out = step(scheduler)
    assert list(out.num_scheduled_tokens) == ["a"]
    assert scheduler.requests["g"].status == RequestStatus.WAITING_FOR_FSM
    assert [r.request_id for r in scheduler.waiting] == ["g"]

    scheduler.add_request(request("b", arrival=2.0))
    grammar.is_ready = True
    out = step(scheduler)
    # Compiled: admitted ahead of the later arrival, as its place says.
    assert [n.req_id for n in out.scheduled_new_reqs] == ["g", "b"]
    assert scheduler.requests["g"].status == RequestStatus.RUNNING


def test_a_complete_grammar_finishes_its_request(scheduler):
    grammar = FakeGrammar(length=2)
    grammar.is_ready = True
    scheduler.add_request(request("g", grammar))
    step(scheduler, token=5)
    assert scheduler.requests["g"].num_output_tokens == 1
    step(scheduler, token=6)
    assert "g" not in scheduler.requests
    assert grammar.accepted == [5, 6]


def test_a_compiling_request_can_be_aborted(scheduler):
    scheduler.add_request(request("g", FakeGrammar()))
    scheduler.finish_requests(["g"], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests() and not scheduler.waiting
