"""One replica's step model against hand-computed step sums."""

from __future__ import annotations

import math

import pytest

from kvpilot.operator.sim.profile import Profile
from kvpilot.operator.sim.replica import Replica, Request

PROFILE = Profile("test", "made up", base_s=0.01, per_token_s=1e-4, per_context_token_s=1e-6, num_gpu_blocks=64,
                  block_size=4, per_sequence_s=3e-4)


class Ledger:
    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.ended: dict[int, tuple[str, float]] = {}

    def first_token(self, request: Request, now: float) -> None:
        self.first[request.index] = now

    def finished(self, request: Request, now: float) -> None:
        assert request.index not in self.ended
        self.ended[request.index] = ("finished", now)

    def timed_out(self, request: Request, now: float) -> None:
        assert request.index not in self.ended
        self.ended[request.index] = ("timed out", now)


def replica(ledger: Ledger, **overrides) -> Replica:
    settings = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "timeout": 1e9, **overrides}
    return Replica("r", overrides.pop("profile", PROFILE), ledger=ledger, **settings)


def run_until_idle(r: Replica, when: float | None) -> None:
    while when is not None:
        when = r.advance(when)


def test_one_request_alone_costs_its_steps_one_by_one():
    ledger = Ledger()
    r = replica(ledger)
    prompt, output = 10, 7
    run_until_idle(r, r.add(Request(0, 0.0, prompt, output, 0), 0.0))
    prefill = PROFILE.step_seconds(prompt, 1, prompt)
    # Decode step g (g tokens generated before it) attends prompt + g + 1 tokens.
    decode = sum(PROFILE.step_seconds(1, 1, prompt + g + 1) for g in range(1, output))
    assert ledger.first[0] == pytest.approx(prefill, rel=1e-12)
    assert ledger.ended[0] == ("finished", pytest.approx(prefill + decode, rel=1e-12))


def test_an_arrival_joins_at_the_end_of_the_step_in_flight():
    ledger = Ledger()
    r = replica(ledger)
    when = r.add(Request(0, 0.0, 8, 100, 0), 0.0)
    r.advance(when)  # prefilled at `when`: from there a run of decode steps
    step = PROFILE.step_seconds(1, 1, 8 + 2)
    arrival = when + 2.5 * step
    change = r.add(Request(1, arrival, 8, 3, 0), arrival)
    assert change is not None and change > arrival
    # The third decode step ends there, and the newcomer's prefill is scheduled from it.
    expected = when + sum(PROFILE.step_seconds(1, 1, 8 + 1 + j) for j in range(1, 4))
    assert change == pytest.approx(expected, rel=1e-9)
    run_until_idle(r, change)
    assert ledger.first[1] == pytest.approx(expected + PROFILE.step_seconds(1 + 8, 2, 8 + 1 + 4 + 8), rel=1e-9)
    assert set(ledger.ended) == {0, 1}


def test_a_full_pool_preempts_and_the_exact_count_never_exceeds_it():
    ledger = Ledger()
    r = replica(ledger, max_num_seqs=16)
    # 8 requests that each end at 40 tokens = 10 blocks: 80 blocks wanted of 64.
    when = None
    for i in range(8):
        when = r.add(Request(i, 0.0, 20, 20, 0), 0.0) or when
    while when is not None:
        assert r.exact_kv_blocks(when) <= r.kv_blocks(when) <= PROFILE.num_gpu_blocks
        when = r.advance(when)
    assert r.preemptions > 0
    assert sorted(ledger.ended) == list(range(8)) and all(kind == "finished" for kind, _ in ledger.ended.values())


def test_priority_admits_the_lower_number_first_and_a_switch_reorders_the_queue():
    ledger = Ledger()
    r = replica(ledger, max_num_seqs=1)
    when = r.add(Request(0, 0.0, 4, 4, 0), 0.0)
    r.add(Request(1, 0.1, 4, 4, 5), 0.1)
    r.add(Request(2, 0.2, 4, 4, 0), 0.2)
    r.set_policy("priority")
    run_until_idle(r, when)
    assert ledger.first[2] < ledger.first[1]


def test_a_request_without_its_first_token_by_the_timeout_is_given_up():
    ledger = Ledger()
    r = replica(ledger, max_num_seqs=1, timeout=0.05)
    when = r.add(Request(0, 0.0, 4, 50, 0), 0.0)
    r.add(Request(1, 0.0, 4, 4, 0), 0.0)
    run_until_idle(r, when)
    assert ledger.ended[1][0] == "timed out" and 1 not in ledger.first
    assert ledger.ended[0][0] == "finished"


def test_steps_done_inverts_the_run_duration():
    ledger = Ledger()
    r = replica(ledger)
    when = r.advance(r.add(Request(0, 0.0, 8, 1000, 0), 0.0))
    start = r.run_start
    for k in (1, 2, 17, r.run_steps):
        exact = r._run_seconds(k)
        assert r._steps_done(exact) == k
        assert r._steps_done(math.nextafter(exact, 0.0)) == k - 1
    assert when == pytest.approx(start + r._run_seconds(r.run_steps))


def test_expiry_drops_the_overdue_without_a_first_token_and_keeps_the_rest_in_order():
    ledger = Ledger()
    r = replica(ledger, max_num_seqs=1, timeout=1.0)
    resumed = Request(1, 0.05, 4, 4, 0)
    resumed.first_token = 0.06  # as after a preemption: its client has its first token and waits on
    r.play([Request(0, 0.0, 4, 200, 0), resumed, Request(2, 0.1, 4, 4, 0)], 1.2)  # 0 holds the seat past 2 s
    r.expire(1.2)
    assert ledger.ended == {2: ("timed out", 1.2)}
    assert [item[3] for item in r.waiting] == [resumed]
    r.play([Request(3, 1.5, 4, 4, 0)], math.inf)
    assert r.empty() and [ledger.ended[i][0] for i in (0, 1, 3)] == ["finished"] * 3
    assert ledger.ended[0][1] < ledger.ended[1][1] < ledger.ended[3][1]
