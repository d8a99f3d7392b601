"""The token-budget scheduler and its waiting queues, driven by a fake model runner."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from kvpilot.runtime.config import SchedulerConfig
from kvpilot.runtime.core.kv_cache_manager import KVCacheManager
from kvpilot.runtime.core.sched.output import (
    ModelRunnerOutput,
    PromptLogprobsChunk,
    SchedulerOutput,
)
from kvpilot.runtime.core.sched.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    create_request_queue,
)
from kvpilot.runtime.core.sched.scheduler import Scheduler
from kvpilot.runtime.outputs import EngineCoreOutput, TokenLogprobs
from kvpilot.runtime.request import Request, RequestStatus, SamplingParams

BLOCK_SIZE = 4
DEFAULT_TOKEN = 7
_arrivals = itertools.count()
# Each request gets its own prompt tokens, so that prefix caching only hits where a test wants.
_prompt_bases = itertools.count(1000, 1000)


def make_request(
    req_id: str,
    prompt_len: int = 4,
    *,
    max_tokens: int = 4,
    priority: int = 0,
    arrival_time: float | None = None,
    eos_token_id: int | None = None,
    prompt: list[int] | None = None,
    **params,
) -> Request:
    # Arrival times follow creation order unless a test says otherwise.
    arrival = next(_arrivals) if arrival_time is None else arrival_time
    base = next(_prompt_bases)
    return Request(
        req_id,
        prompt if prompt is not None else list(range(base, base + prompt_len)),
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_id=eos_token_id,
        arrival_time=arrival,
        priority=priority,
    )


@dataclass
class _Row:
    token_ids: list[int]
    num_computed: int
    block_ids: list[int]


@dataclass
class FakeRunner:
    """Mirrors the runner's persistent rows from SchedulerOutputs only, and checks the protocol.

    A request whose prefill completes this step samples the next token of its script, then
    DEFAULT_TOKEN; a request still prefilling samples nothing.
    """

    scripts: dict[str, list[int]] = field(default_factory=dict)
    rows: dict[str, _Row] = field(default_factory=dict)
    # Under pipeline parallelism a row gains its tokens from the scheduler, with its next step.
    tokens_shipped: bool = False

    def __call__(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids + out.preempted_req_ids:
            self.rows.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.rows, f"{new.req_id} sent as new but has a row"
            self.rows[new.req_id] = _Row(
                list(new.token_ids), new.num_computed_tokens, list(new.block_ids)
            )
        # Only requests that gained blocks (or tokens) are listed; every other scheduled one needs its row.
        for cached in out.scheduled_cached_reqs:
            assert cached.req_id in out.num_scheduled_tokens and (cached.new_block_ids or cached.new_token_ids)
            assert self.tokens_shipped or not cached.new_token_ids
            self.rows[cached.req_id].block_ids += cached.new_block_ids
            self.rows[cached.req_id].token_ids += cached.new_token_ids
        assert set(out.num_scheduled_tokens) <= set(self.rows)

        req_ids, sampled = [], []
        for req_id, num in out.num_scheduled_tokens.items():
            row = self.rows[req_id]
            row.num_computed += num
            assert 0 < num and row.num_computed <= len(row.token_ids)
            # Every slot written this step must lie in a block the request holds.
            assert len(row.block_ids) * BLOCK_SIZE >= row.num_computed
            tokens = []
            if row.num_computed == len(row.token_ids):
                script = self.scripts.get(req_id)
                tokens = [script.pop(0) if script else DEFAULT_TOKEN]
                if not self.tokens_shipped:
                    row.token_ids += tokens
            req_ids.append(req_id)
            sampled.append(tokens)
        return ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids))


class Harness:
    """The engine core's loop, checking the step invariants on every step."""

    pipeline_depth = 1

    def __init__(self, num_blocks: int = 64, enable_caching: bool = False, **config) -> None:
        self.config = SchedulerConfig(**config)
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=enable_caching)
        self.full = self.kv.num_free_blocks
        self.sched = Scheduler(self.config, self.kv, pipeline_depth=self.pipeline_depth)
        self.runner = FakeRunner(tokens_shipped=self.pipeline_depth > 1)
        self.outputs: dict[str, list[EngineCoreOutput]] = {}
        self.finished_ids: Counter[str] = Counter()
        self.steps: list[SchedulerOutput] = []

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.sched.add_request(request)

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self._check(out)
        self._apply(out, self._run(out))
        self.steps.append(out)
        return out

    def _check(self, out: SchedulerOutput) -> None:
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= self.config.max_num_seqs
        assert self.sched.num_running <= self.config.max_num_seqs
        self.finished_ids.update(out.finished_req_ids)

    def _run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        runner_output = self.runner(out)
        # The runner advanced its rows by the counts alone, and agrees with the scheduler.
        for req_id in out.num_scheduled_tokens:
            assert self.runner.rows[req_id].num_computed == self.sched.requests[req_id].num_computed_tokens
        return runner_output

    def _apply(self, out: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        for core_output in self.sched.update_from_output(out, runner_output):
            self.outputs.setdefault(core_output.request_id, []).append(core_output)

    def step_until(self, done, max_steps: int = 100) -> SchedulerOutput:
        for _ in range(max_steps):
            out = self.step()
            if done(out):
                return out
        raise AssertionError("condition never met")

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                # One more step hands the last finished ids to the runner.
                self.step()
                return
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps: {self.sched.requests}")

    def tokens(self, req_id: str) -> list[int]:
        return [t for o in self.outputs.get(req_id, []) for t in o.new_token_ids]

    def finish_reason(self, req_id: str) -> str | None:
        return self.outputs[req_id][-1].finish_reason


class AsyncHarness(Harness):
    """The async engine core's loop: step N+1 is scheduled before step N's tokens are applied.

    The runner runs each step as soon as it is scheduled, which is what the model thread does
    (steps run in order), so the scheduler never sees a step's tokens before it schedules the next.
    """

    in_flight_limit = 2

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
        # Preemptions of requests whose token was still in flight: the case async adds.
        self.preempted_in_flight = 0

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self._check(out)
        self.preempted_in_flight += sum(self.sched.requests[r].num_output_placeholders > 0
                                        for r in out.preempted_req_ids)
        idle = out.is_empty and not (out.finished_req_ids or out.preempted_req_ids)
        if not (idle and self.in_flight):
            self.in_flight.append((out, self._run(out)))
        if len(self.in_flight) == self.in_flight_limit or (idle and self.in_flight):
            self._apply(*self.in_flight.pop(0))
        self.steps.append(out)
        return out

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not (self.sched.has_unfinished_requests() or self.in_flight):
                self.step()
                return
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps: {self.sched.requests}")


class PipelinedHarness(AsyncHarness):
    """The core's loop under pipeline parallelism over three stages: up to three steps in flight,
    and the runner's rows gain their tokens from the SchedulerOutputs alone."""

    pipeline_depth = in_flight_limit = 3


HARNESSES = pytest.mark.parametrize("harness", [Harness, AsyncHarness, PipelinedHarness],
                                    ids=["sync", "async", "pipelined"])


# --- the waiting queues -------------------------------------------------------------------------


def test_fcfs_queue_keeps_arrival_order_with_prepend_at_head():
    queue = FCFSRequestQueue()
    a, b, c, d = (make_request(x) for x in "abcd")
    for r in (a, b, c):
        queue.add_request(r)
    queue.prepend_request(d)
    assert [r.request_id for r in queue] == ["d", "a", "b", "c"]
    queue.remove_request(b)
    assert queue.pop_request() is d
    assert queue.peek_request() is a
    assert len(queue) == 2 and queue
    queue.remove_requests([a, c])
    assert len(queue) == 0 and not queue
    with pytest.raises(IndexError):
        queue.pop_request()


def test_priority_queue_orders_by_priority_then_arrival_then_id():
    queue = PriorityRequestQueue()
    x = make_request("x", priority=1, arrival_time=0.0)
    w = make_request("w", priority=1, arrival_time=0.0)
    y = make_request("y", priority=0, arrival_time=5.0)
    z = make_request("z", priority=0, arrival_time=3.0)
    for r in (x, w, y, z):
        queue.add_request(r)
    assert [r.request_id for r in queue] == ["z", "y", "w", "x"]
    queue.remove_request(y)
    assert queue.pop_request() is z
    assert queue.peek_request() is w
    queue.prepend_request(y)
    assert [r.request_id for r in queue] == ["y", "w", "x"]
    assert [queue.pop_request().request_id for _ in range(3)] == ["y", "w", "x"]
    assert not queue
    with pytest.raises(IndexError):
        queue.peek_request()


def test_priority_queue_lazy_deletion_survives_many_removals():
    queue = PriorityRequestQueue()
    requests = [make_request(f"r{i:03}", priority=i % 7, arrival_time=float(i)) for i in range(100)]
    for r in requests:
        queue.add_request(r)
    kept = requests[::10]
    queue.remove_requests(r for r in requests if r not in kept)
    assert len(queue) == len(kept)
    expected = sorted(kept, key=lambda r: (r.priority, r.arrival_time))
    assert list(queue) == expected
    assert [queue.pop_request() for _ in range(len(kept))] == expected


def test_priority_queue_a_reused_request_id_waits_in_its_own_place():
    # An aborted request's key lingers in the heap; a later request with the same id (an id is
    # free again once its request finished) must not take that key's place in the order.
    queue = PriorityRequestQueue()
    aborted, other = make_request("a", priority=5), make_request("b", priority=7)
    queue.add_request(aborted)
    queue.add_request(other)
    queue.remove_request(aborted)
    reused = make_request("a", priority=9)
    queue.add_request(reused)
    assert queue.peek_request() is other
    assert [queue.pop_request() for _ in range(2)] == [other, reused]
    assert not queue


def test_create_request_queue_names_an_unknown_policy():
    assert isinstance(create_request_queue("fcfs"), FCFSRequestQueue)
    assert isinstance(create_request_queue("priority"), PriorityRequestQueue)
    with pytest.raises(ValueError, match="lifo"):
        create_request_queue("lifo")


# --- budget, order and chunking -----------------------------------------------------------------


def test_budget_and_max_num_seqs_hold_over_a_whole_run():
    h = Harness(num_blocks=200, max_num_batched_tokens=16, max_num_seqs=3)
    lengths = [3, 17, 9, 30, 1, 12, 25, 6, 8, 40]
    h.add(*(make_request(f"r{i}", n, max_tokens=5) for i, n in enumerate(lengths)))
    h.run()  # the harness asserts both bounds on every step
    assert max(o.total_num_scheduled_tokens for o in h.steps) == 16
    assert max(len(o.num_scheduled_tokens) for o in h.steps) == 3
    for i in range(len(lengths)):
        assert h.tokens(f"r{i}") == [DEFAULT_TOKEN] * 5
        assert h.finish_reason(f"r{i}") == "length"
    assert h.kv.num_free_blocks == h.full


def test_running_requests_are_scheduled_before_waiting_ones():
    h = Harness(max_num_batched_tokens=8)
    h.add(make_request("a", 4, max_tokens=10))
    h.step()
    h.add(make_request("b", 20))
    out = h.step()
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 7)]
    assert [r.req_id for r in out.scheduled_cached_reqs] == ["a"]
    assert [r.req_id for r in out.scheduled_new_reqs] == ["b"]


def test_long_prompt_is_prefilled_in_chunks_over_several_steps():
    h = Harness(max_num_batched_tokens=8)
    h.add(make_request("a", 20, max_tokens=2))

    first = h.step()
    assert first.num_scheduled_tokens == {"a": 8}
    [new] = first.scheduled_new_reqs
    assert (new.num_computed_tokens, len(new.token_ids), len(new.block_ids)) == (0, 20, 2)
    assert "a" not in h.outputs  # nothing sampled mid-prefill

    second = h.step()
    [cached] = second.scheduled_cached_reqs
    assert second.num_scheduled_tokens == {"a": 8}
    assert len(cached.new_block_ids) == 2

    third = h.step()
    [cached] = third.scheduled_cached_reqs
    assert third.num_scheduled_tokens == {"a": 4}
    assert len(cached.new_block_ids) == 1
    assert h.tokens("a") == [DEFAULT_TOKEN]

    fourth = h.step()
    assert fourth.num_scheduled_tokens == {"a": 1}
    assert h.tokens("a") == [DEFAULT_TOKEN] * 2 and h.finish_reason("a") == "length"


def test_long_prefill_token_threshold_caps_each_chunk():
    h = Harness(max_num_batched_tokens=64, long_prefill_token_threshold=5)
    h.add(make_request("a", 12), make_request("b", 12))
    counts = [h.step().num_scheduled_tokens for _ in range(4)]
    assert counts == [
        {"a": 5, "b": 5},
        {"a": 5, "b": 5},
        {"a": 2, "b": 2},
        {"a": 1, "b": 1},
    ]


# --- preemption ---------------------------------------------------------------------------------


def _preemption_scenario(policy: str, enable_caching: bool = False) -> Harness:
    """Four usable blocks, chunks of 4: at step 3 `a` needs a third block and none is free.

    `a` (prompt 8, priority 5) and `v` (prompt 7, priority 0) each hold two blocks and one
    sampled token; under FCFS `a` was admitted first.
    """
    h = Harness(
        num_blocks=5,
        enable_caching=enable_caching,
        long_prefill_token_threshold=4,
        max_num_seqs=2,
        policy=policy,
    )
    h.add(
        make_request("a", 8, max_tokens=4, priority=5),
        make_request("v", 7, max_tokens=3, priority=0),
    )
    h.step()
    h.step()
    assert h.kv.num_free_blocks == 0 and h.tokens("a") == h.tokens("v") == [DEFAULT_TOKEN]
    return h


def test_fcfs_preempts_the_last_admitted_and_admits_nothing_in_that_step():
    h = _preemption_scenario("fcfs")
    h.add(make_request("w", 1))  # no seat for it until `v` goes
    out = h.step()
    # `v` is last admitted, though its priority value is the lower one.
    assert out.preempted_req_ids == ["v"]
    assert out.num_scheduled_tokens == {"a": 1}
    # `v` heads the queue and its first chunk would fit, yet it waits for the next step.
    assert not out.scheduled_new_reqs
    assert h.kv.num_free_blocks >= 1
    v = h.sched.requests["v"]
    assert v.status == RequestStatus.PREEMPTED and v.num_computed_tokens == 0
    assert v.num_preemptions == 1 and h.sched.num_preemptions == 1
    assert [r.request_id for r in h.sched.waiting] == ["v", "w"]


def test_preempted_request_resumes_as_new_with_its_output_and_finishes_at_full_length():
    h = _preemption_scenario("fcfs")
    h.step()
    out = h.step()
    [new] = out.scheduled_new_reqs
    assert new.req_id == "v"
    v = h.sched.requests["v"]
    assert new.token_ids == v.prompt_token_ids + [DEFAULT_TOKEN]
    assert new.num_prompt_tokens == 7 and new.num_computed_tokens == 0
    assert new.block_ids == h.kv.get_block_ids("v")
    h.run()
    assert h.tokens("v") == [DEFAULT_TOKEN] * 3 and h.finish_reason("v") == "length"
    assert v.num_tokens == 10 and v.output_token_ids == [DEFAULT_TOKEN] * 3
    assert h.tokens("a") == [DEFAULT_TOKEN] * 4
    assert h.kv.num_free_blocks == h.full


def test_num_cached_tokens_is_set_at_first_admission_only():
    h = _preemption_scenario("fcfs", enable_caching=True)
    h.step()  # preempts `v`
    out = h.step_until(lambda o: o.scheduled_new_reqs)
    [new] = out.scheduled_new_reqs
    # `v` resumes from its own first block, still in the prefix cache.
    assert new.req_id == "v" and new.num_computed_tokens == BLOCK_SIZE
    h.run()
    assert h.outputs["v"][-1].num_cached_tokens == 0


def test_priority_policy_preempts_the_largest_priority_value_even_if_it_is_the_requester():
    h = _preemption_scenario("priority")
    out = h.step()
    # `a` asks for the block but has the larger priority value, so it gives way itself.
    assert out.preempted_req_ids == ["a"]
    assert out.num_scheduled_tokens == {"v": 1}
    assert not out.scheduled_new_reqs


def test_priority_victim_scheduled_earlier_in_the_step_gives_its_tokens_back():
    h = Harness(num_blocks=6, policy="priority")
    h.add(
        make_request("mid", 4, max_tokens=10, priority=1),
        make_request("low", 4, max_tokens=10, priority=5),
    )
    h.step()
    h.add(make_request("high", 3, max_tokens=10, priority=0))
    h.step()
    assert list(h.sched.running) == ["mid", "low", "high"]
    out = h.step_until(lambda o: o.preempted_req_ids)
    # `low` was scheduled before `high` ran out of blocks; it is neither first nor last admitted.
    assert out.preempted_req_ids == ["low"]
    assert out.num_scheduled_tokens == {"mid": 1, "high": 1}
    assert out.total_num_scheduled_tokens == 2
    # `mid` still fits the blocks it holds: it ships only its count.
    assert [r.req_id for r in out.scheduled_cached_reqs] == ["high"]
    h.run()
    for req_id in ("mid", "low", "high"):
        assert h.tokens(req_id) == [DEFAULT_TOKEN] * 10


@HARNESSES
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_every_request_finishes_once_under_memory_pressure(policy, harness):
    rng = random.Random(0)
    h = harness(num_blocks=12, max_num_batched_tokens=24, max_num_seqs=6, policy=policy)
    requests = [
        make_request(
            f"r{i}", rng.randint(1, 20), max_tokens=rng.randint(1, 12), priority=rng.randint(0, 3)
        )
        for i in range(25)
    ]
    h.add(*requests)
    h.run()
    assert h.sched.num_preemptions > 0
    for r in requests:
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert h.tokens(r.request_id) == [DEFAULT_TOKEN] * r.max_tokens
        assert [o.finished for o in h.outputs[r.request_id]].count(True) == 1
    assert h.finished_ids == Counter(r.request_id for r in requests)
    assert h.sched.num_running == h.sched.num_waiting == 0
    assert h.kv.num_free_blocks == h.full and h.kv.usage == 0.0
    assert all(r.num_output_placeholders == 0 for r in requests)
    if issubclass(harness, AsyncHarness):
        assert h.preempted_in_flight > 0


def test_pipelined_steps_each_take_a_share_of_the_running_requests_and_ship_their_tokens():
    h = PipelinedHarness(max_num_seqs=8)
    h.add(*(make_request(f"r{i}", 2, max_tokens=30) for i in range(6)))
    for _ in range(24):
        h.step()
    decodes = [out for out in h.steps if out.num_scheduled_tokens][1:]  # after the prefill of all six
    # Three stages, six running: two requests a step, so that each stage has a step to run.
    assert all(len(out.num_scheduled_tokens) == 2 for out in decodes)
    # A request waits while its token is in flight: never in two of the steps in the pipeline.
    for window in zip(decodes, decodes[1:], decodes[2:]):
        scheduled = [req_id for out in window for req_id in out.num_scheduled_tokens]
        assert len(scheduled) == len(set(scheduled))
    # Each decode ships the one token sampled since its request's last step, to every stage.
    for out in decodes:
        assert {c.req_id: c.new_token_ids for c in out.scheduled_cached_reqs} == \
            {req_id: [DEFAULT_TOKEN] for req_id in out.num_scheduled_tokens}


# --- set_policy ---------------------------------------------------------------------------------


def test_set_policy_round_trip_keeps_every_waiting_request_once():
    h = _preemption_scenario("fcfs")
    h.step()  # preempts `v` (priority 0)
    h.add(
        make_request("w0", 4, priority=3, arrival_time=-1.0),
        make_request("w1", 4, priority=3, arrival_time=100.0),
        make_request("w2", 4, priority=-1, arrival_time=101.0),
        make_request("w3", 4, priority=3, arrival_time=99.0),
    )
    sched = h.sched
    order = lambda: [r.request_id for r in sched.waiting]  # noqa: E731
    assert order() == ["v", "w0", "w1", "w2", "w3"]
    sched.set_policy("fcfs")  # the current policy: nothing moves, though w3 arrived before w1
    assert order() == ["v", "w0", "w1", "w2", "w3"]

    sched.set_policy("priority")
    assert sched.policy == "priority"
    assert order() == ["w2", "v", "w0", "w3", "w1"]

    with pytest.raises(ValueError, match="lifo"):
        sched.set_policy("lifo")
    assert sched.policy == "priority" and order() == ["w2", "v", "w0", "w3", "w1"]

    sched.finish_requests(["w3"], RequestStatus.FINISHED_ABORTED)
    sched.set_policy("fcfs")
    # The preempted request keeps the head, though `w0` arrived first; the rest go by arrival.
    assert order() == ["v", "w0", "w1", "w2"]
    assert sched.num_waiting == 4

    h.run()
    assert h.finished_ids == Counter(["a", "v", "w0", "w1", "w2", "w3"])
    assert h.kv.num_free_blocks == h.full


def test_victim_choice_follows_a_policy_set_at_runtime():
    h = _preemption_scenario("fcfs")
    h.sched.set_policy("priority")
    assert h.step().preempted_req_ids == ["a"]


# --- stop conditions ----------------------------------------------------------------------------


EOS = 2
# id, sampling params, the tokens the model samples, max_model_len (None: none),
# how many of those tokens the request keeps, finish_reason, stop_reason
STOP_CASES = [
    ("min_tokens-holds-eos", dict(min_tokens=3), [EOS] * 4, None, 3, "stop", None),
    ("min_tokens-holds-stop-id", dict(min_tokens=2, stop_token_ids=[9]), [9, 9], None, 2, "stop", 9),
    ("eos-before-stop-id", dict(stop_token_ids=[EOS]), [5, EOS], None, 2, "stop", None),
    ("stop-id-before-max_tokens", dict(max_tokens=2, stop_token_ids=[9]), [5, 9], None, 2, "stop", 9),
    ("eos-before-max_tokens", dict(max_tokens=2), [5, EOS], None, 2, "stop", None),
    ("ignore_eos", dict(max_tokens=3, ignore_eos=True), [EOS] * 3, None, 3, "length", None),
    ("max_model_len", dict(max_tokens=100), [5] * 3, 6, 2, "length", None),
    ("max_tokens", dict(max_tokens=3), [5] * 4, None, 3, "length", None),
]


@HARNESSES
@pytest.mark.parametrize(
    "params, sampled, max_model_len, num_kept, reason, stop_reason",
    [case[1:] for case in STOP_CASES],
    ids=[case[0] for case in STOP_CASES],
)
def test_stop_checks_run_in_order(params, sampled, max_model_len, num_kept, reason, stop_reason, harness):
    h = harness(max_model_len=max_model_len)
    request = make_request("r", 4, eos_token_id=EOS, **{"max_tokens": 10, **params})
    h.runner.scripts["r"] = list(sampled)
    h.add(request)
    h.run()
    assert h.tokens("r") == sampled[:num_kept]
    last = h.outputs["r"][-1]
    assert (last.finish_reason, last.stop_reason) == (reason, stop_reason)
    assert request.stop_reason == stop_reason
    assert all(not o.finished for o in h.outputs["r"][:-1])


class _NoListScans(list):
    """Stop ids that refuse a linear membership test, which costs per token what the list is long."""

    def __contains__(self, item) -> bool:
        raise AssertionError("stop_token_ids scanned as a list")


def test_stop_token_ids_are_checked_in_constant_time():
    h = Harness()
    stop_ids = [9, *range(100, 1100)]
    request = make_request("r", 4, max_tokens=10, stop_token_ids=stop_ids)
    request.sampling_params.stop_token_ids = _NoListScans(stop_ids)
    h.runner.scripts["r"] = [5, 6, 9, 7]
    h.add(request)
    h.run()
    assert h.tokens("r") == [5, 6, 9] and request.stop_reason == 9


# --- finish_requests ----------------------------------------------------------------------------


def test_finish_requests_frees_waiting_and_running_and_reports_each_id_once():
    h = Harness(max_num_seqs=1)
    a, b = make_request("a", 8, max_tokens=10), make_request("b", 8)
    h.add(a, b)
    h.step()
    assert h.sched.num_running == 1 and h.sched.num_waiting == 1
    assert h.kv.num_free_blocks < h.full

    h.sched.finish_requests(["a", "b", "unknown", "a"], RequestStatus.FINISHED_ABORTED)
    assert h.kv.num_free_blocks == h.full
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert not h.sched.has_unfinished_requests() and h.sched.get_num_unfinished_requests() == 0
    assert h.sched.num_running == h.sched.num_waiting == 0

    out = h.step()
    assert out.finished_req_ids == ["a", "b"] and out.is_empty
    assert h.step().finished_req_ids == []

    with pytest.raises(ValueError, match="RUNNING"):
        h.sched.finish_requests(["a"], RequestStatus.RUNNING)


def test_request_aborted_between_schedule_and_update_gets_no_output():
    h = Harness()
    h.add(make_request("a", 4, max_tokens=10))
    out = h.sched.schedule()
    runner_output = h.runner(out)
    h.sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert h.sched.update_from_output(out, runner_output) == []
    assert h.sched.schedule().finished_req_ids == ["a"]
    assert h.kv.num_free_blocks == h.full


# --- outputs ------------------------------------------------------------------------------------


def test_prefix_hit_sets_num_cached_tokens_and_the_starting_position():
    h = Harness(enable_caching=True)
    prompt = list(range(1, 10))
    h.add(make_request("a", prompt=prompt, max_tokens=1))
    h.run()
    h.add(make_request("b", prompt=prompt, max_tokens=1))
    out = h.step()
    [new] = out.scheduled_new_reqs
    # 9 tokens: two whole blocks hit, the last token is computed.
    assert new.num_computed_tokens == 8 and out.num_scheduled_tokens == {"b": 1}
    assert h.outputs["a"][-1].num_cached_tokens == 0
    assert h.outputs["b"][-1].num_cached_tokens == 8


def test_logprobs_and_prompt_logprobs_pass_through():
    h = Harness(max_num_batched_tokens=4)
    h.add(make_request("a", 6, max_tokens=3, logprobs=1, prompt_logprobs=1))
    entry = TokenLogprobs([3], [-0.5], [1])
    out = h.sched.schedule()
    chunk = PromptLogprobsChunk(0, [entry] * 4)
    [first] = h.sched.update_from_output(out, ModelRunnerOutput(["a"], [[]], [None], {"a": chunk}))
    # Mid-prefill, prompt logprobs alone make an output.
    assert first.new_token_ids == [] and first.new_prompt_logprobs is chunk and not first.finished

    out = h.sched.schedule()
    [second] = h.sched.update_from_output(out, ModelRunnerOutput(["a"], [[8]], [[entry]]))
    assert second.new_token_ids == [8] and second.new_logprobs == [entry]
    assert second.new_prompt_logprobs is None


def test_the_scheduler_never_imports_torch():
    code = "import sys, kvpilot.runtime.core.sched.scheduler; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONSAFEPATH": "1"}).returncode == 0


# --- async scheduling ---------------------------------------------------------------------------


def test_async_schedules_the_next_decode_before_its_token_is_known():
    h = AsyncHarness()
    request = make_request("a", 4, max_tokens=5)
    h.add(request)
    assert h.step().num_scheduled_tokens == {"a": 4}
    # The prefill's token is in flight: the decode that feeds it is scheduled anyway.
    assert h.step().num_scheduled_tokens == {"a": 1}
    # Step 1's token has come back since; step 2's is the one in flight.
    assert h.tokens("a") == [DEFAULT_TOKEN] and request.num_output_placeholders == 1
    assert request.num_computed_tokens == request.num_tokens == 5


def test_async_drops_the_token_sampled_after_a_request_finished():
    h = AsyncHarness()
    h.add(make_request("a", 4, max_tokens=10, eos_token_id=EOS))
    h.runner.scripts["a"] = [5, EOS, 6, 7]
    h.run()
    # The step after the EOS ran (it was scheduled before the EOS was known); its 6 is not a's.
    assert h.tokens("a") == [5, EOS] and h.finish_reason("a") == "stop"
    assert h.runner.scripts["a"] == [7]
    assert h.finished_ids == Counter(["a"]) and "a" not in h.runner.rows
    assert h.kv.num_free_blocks == h.full


def test_async_a_reused_request_id_never_gets_the_token_sampled_for_its_old_request():
    h = AsyncHarness()
    h.add(make_request("a", 4, max_tokens=10, eos_token_id=EOS))
    h.runner.scripts["a"] = [EOS, 5]
    h.step_until(lambda out: "a" not in h.sched.requests)
    # The step after the EOS is in flight: its token (5) was sampled for the request that ended.
    assert h.in_flight and "a" in h.in_flight[0][0].num_scheduled_tokens
    assert h.tokens("a") == [EOS] and not h.runner.scripts["a"]
    # The id is free again, and a new request takes it before that step's output is applied.
    h.outputs.pop("a")
    h.add(make_request("a", 3, max_tokens=3))
    h.runner.scripts["a"] = [21, 22, 23]
    h.run()
    assert h.tokens("a") == [21, 22, 23] and h.finish_reason("a") == "length"
    assert h.kv.num_free_blocks == h.full and not h.runner.rows


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_async_never_schedules_past_max_tokens(max_tokens):
    runs = {}
    for harness in (Harness, AsyncHarness):
        h = harness(max_model_len=4 + max_tokens)
        h.add(make_request("a", 4, max_tokens=max_tokens))
        h.run()
        assert h.tokens("a") == [DEFAULT_TOKEN] * max_tokens
        runs[harness] = sum("a" in out.num_scheduled_tokens for out in h.steps)
    # Nothing runs that could only produce a token past the limit (or past max_model_len).
    assert runs[AsyncHarness] == runs[Harness] == max_tokens


def test_async_abort_while_a_step_is_in_flight():
    h = AsyncHarness()
    h.add(make_request("a", 4, max_tokens=10), make_request("b", 4, max_tokens=6))
    h.step()
    h.step()
    assert h.in_flight and "a" in h.in_flight[0][0].num_scheduled_tokens
    h.sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    tokens_at_abort = h.tokens("a")
    h.run()
    assert h.tokens("a") == tokens_at_abort and all(not o.finished for o in h.outputs["a"])
    assert h.tokens("b") == [DEFAULT_TOKEN] * 6
    assert h.finished_ids == Counter(["a", "b"]) and not h.runner.rows
    assert h.kv.num_free_blocks == h.full


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_async_outputs_equal_sync_outputs_under_preemption_and_stops(policy):
    def workload():
        rng = random.Random(7)
        requests, scripts = [], {}
        for i in range(30):
            params = dict(max_tokens=rng.randint(1, 12), priority=rng.randint(0, 3))
            if i % 3 == 0:
                params.update(stop_token_ids=[9], min_tokens=rng.randint(0, params["max_tokens"]))
            requests.append(make_request(f"r{i}", rng.randint(1, 20), eos_token_id=EOS, **params))
            scripts[f"r{i}"] = [rng.choice([5, 6, 9, EOS, 11, 12, 13]) for _ in range(20)]
        return requests, scripts

    results = {}
    for harness in (Harness, AsyncHarness):
        h = harness(num_blocks=12, max_num_batched_tokens=24, max_num_seqs=6, policy=policy)
        requests, h.runner.scripts = workload()
        h.add(*requests)
        h.run()
        assert h.sched.num_preemptions > 0
        assert h.kv.num_free_blocks == h.full and not h.runner.rows
        results[harness] = {r.request_id: (h.tokens(r.request_id), h.finish_reason(r.request_id),
                                           r.stop_reason) for r in requests}
    assert results[AsyncHarness] == results[Harness]
    assert {reason for _, reason, _ in results[Harness].values()} == {"stop", "length"}
