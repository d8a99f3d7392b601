"""Scale to zero in the simulator: the router holds what arrives while no replica is ready, the
held count wakes the engine through the operator's own autoscaler, and a replica woken pays its
start-up again. Simulated quantities only, on traces of a handful of requests."""

from __future__ import annotations

import numpy as np

from kvpilot.operator.sim import fleet, profile, strategies, trace
from kvpilot.operator.sim.fleet import HOLD_TIMED_OUT, SERVED

H200 = profile.BUILTIN["h200-llama-8b"]
# A client that waits out a wake: an interval and a start-up.
ENGINE = fleet.Engine(startup_seconds=60.0, request_timeout_seconds=300.0)
# Idle for a minute, the engine goes to zero.
SETTINGS = strategies.Settings(max_replicas=4, scale_to_zero_after_seconds=60.0)


def sparse(*times: float, duration: float) -> trace.Trace:
    """Short requests at `times`, one tenant."""
    count = len(times)
    return trace.Trace(np.array(times), np.zeros(count, np.int16), np.full(count, 256, np.int64),
                       np.full(count, 64, np.int64), ("default",), duration)


def run(load: trace.Trace, name: str, hold_timeout_seconds: float = 300.0) -> fleet.Run:
    loop = strategies.build(name, SETTINGS, initial=1, peak=1, mean=1)
    return fleet.simulate(load, loop, H200, ENGINE, routing_name="least-loaded",
                          hold_timeout_seconds=hold_timeout_seconds, check_invariants=True)


def test_a_request_at_zero_is_held_and_served_after_the_wake_past_the_start_up():
    result = run(sparse(0.0, 601.0, duration=1200.0), "kvpilot+zero")
    assert 0 in result.series.desired[: 601 // 15]  # the first request done, the engine went to zero
    assert result.wakes == 1
    assert result.held.tolist() == [False, True]
    assert (result.outcome == SERVED).all()
    assert result.first_token[1] - 601.0 >= ENGINE.startup_seconds


def test_replica_hours_fall_against_min_replicas_1_with_hours_of_idleness():
    load = sparse(0.0, 3600.0, 7200.0, duration=10800.0)
    always, to_zero = run(load, "kvpilot"), run(load, "kvpilot+zero")
    assert (always.outcome == SERVED).all() and (to_zero.outcome == SERVED).all()
    assert always.replica_seconds == 10800.0
    assert to_zero.replica_seconds < always.replica_seconds / 4
    assert to_zero.wakes == 2 and always.wakes == 0


def test_a_request_held_past_the_hold_timeout_fails():
    # The replica takes 60 s to start; the router holds for 30.
    result = run(sparse(0.0, 601.0, duration=1200.0), "kvpilot+zero", hold_timeout_seconds=30.0)
    assert result.outcome[1] == HOLD_TIMED_OUT and result.finish[1] == 631.0
    assert np.isnan(result.first_token[1])


def test_zero_runs_the_policy_tuner_unless_fcfs_is_pinned():
    tuned, pinned = (strategies.build(name, SETTINGS, initial=1, peak=1, mean=1)
                     for name in ("kvpilot+zero", "kvpilot+zero+fcfs"))
    assert tuned.spec["autoscaling"]["minReplicas"] == pinned.spec["autoscaling"]["minReplicas"] == 0
    assert (tuned.spec["scheduling"]["policy"], pinned.spec["scheduling"]["policy"]) == ("auto", "fcfs")
