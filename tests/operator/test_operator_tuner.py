"""The policy tuner as a pure function, over timelines of per-interval queue readings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from inference_engines import engine
from kvpilot.operator import samples, tuner

INTERVAL = 15
TARGET = 5  # the CRD's default targetQueueDepth


def spec(policy: str = "auto", **scheduling: Any) -> dict[str, Any]:
    return engine({
        "model": {"name": "m", "pvc": {"claimName": "models"}}, "image": "i", "replicas": 4,
        "scheduling": {"policy": policy, **scheduling},
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4},
    })["spec"]


# A step: (queue depth of each ready replica, can the engine still scale?)
Step = tuple[Sequence[float], bool]


def timeline(engine_spec: dict[str, Any], steps: Sequence[Step], *,
             start: tuner.TunerState = tuner.TunerState()) -> list[tuner.PolicyDecision]:
    """One decision per interval, each fed the state of the one before."""
    decisions, state = [], start
    for index, (depths, can_scale) in enumerate(steps):
        decision = tuner.decide_policy(engine_spec, can_scale=can_scale, queue_depths=depths,
                                       previous=state, now=1000.0 + index * INTERVAL)
        decisions.append(decision)
        state = decision.state
    return decisions


def policies(decisions: Sequence[tuner.PolicyDecision]) -> list[str]:
    return [d.policy for d in decisions]


BUSY = ([9.0, 7.0], False)  # 8 per replica, at maxReplicas
CALM = ([1.0, 0.0], False)


def test_sustained_queue_at_max_replicas_switches_on_the_second_interval() -> None:
    decisions = timeline(spec(), [CALM, BUSY, BUSY, BUSY])
    assert policies(decisions) == ["fcfs", "fcfs", "priority", "priority"]
    assert [d.reason for d in decisions[:3]] == ["Calm", "PressureBuilding", "QueueAboveTarget"]
    assert decisions[2].message == "8 waiting requests per replica (target 5) for 2 intervals, and the engine cannot scale further"


def test_one_busy_interval_is_a_burst_not_pressure() -> None:
    assert policies(timeline(spec(), [BUSY, CALM, BUSY, CALM, BUSY, CALM])) == ["fcfs"] * 6


def test_an_engine_that_can_still_scale_is_left_to_the_autoscaler() -> None:
    scalable = ([9.0, 7.0], True)
    decisions = timeline(spec(), [scalable, scalable, scalable, BUSY, BUSY])
    assert policies(decisions) == ["fcfs", "fcfs", "fcfs", "fcfs", "priority"]
    assert decisions[0].reason == "ScalingOut"


def test_a_queue_while_replicas_start_is_short_capacity_even_below_max_replicas() -> None:
    """The replicas asked for are minutes from serving: priority meanwhile, fcfs once none starts
    and the autoscaler could add more."""
    decisions, state = [], tuner.TunerState()
    for index, starting in enumerate([0, 2, 2, 0]):
        decision = tuner.decide_policy(spec(), can_scale=True, queue_depths=[9.0, 7.0], previous=state,
                                       now=1000.0 + index * INTERVAL, starting=starting)
        decisions.append(decision)
        state = decision.state
    assert [d.reason for d in decisions] == ["ScalingOut", "PressureBuilding", "QueueAboveTarget", "QueueAboveTarget"]
    assert policies(decisions) == ["fcfs", "fcfs", "priority", "priority"]
    assert decisions[2].message == "8 waiting requests per replica (target 5) for 2 intervals, and 2 replicas still starting"


def test_queue_exactly_at_target_is_not_pressure() -> None:
    at_target = ([5.0, 5.0], False)
    assert policies(timeline(spec(), [at_target] * 4)) == ["fcfs"] * 4


def test_back_to_fcfs_only_after_a_whole_calm_window() -> None:
    window = 60  # four intervals
    steps = [BUSY, BUSY] + [CALM] * 6
    decisions = timeline(spec(calmWindowSeconds=window), steps)
    # Calm starts at the third reading (t=30); 60 s later, at t=90, the window has passed.
    assert policies(decisions) == ["fcfs", "priority", "priority", "priority", "priority", "priority", "fcfs", "fcfs"]
    assert decisions[5].reason == "Calming" and decisions[5].message.endswith("for 45s of 60s")
    assert decisions[6].reason == "CalmWindowPassed"


def test_pressure_inside_the_calm_window_starts_it_over() -> None:
    steps = [BUSY, BUSY, CALM, CALM, CALM, BUSY, CALM, CALM, CALM, CALM, CALM]
    result = policies(timeline(spec(calmWindowSeconds=60), steps))
    assert result == ["fcfs"] + ["priority"] * 9 + ["fcfs"]


def test_default_calm_window_is_300_seconds() -> None:
    assert spec()["scheduling"]["calmWindowSeconds"] == 300
    steps = [BUSY, BUSY] + [CALM] * 22  # calm from the 3rd interval: t=30 .. t=345
    result = policies(timeline(spec(), steps))
    assert result.index("fcfs", 1) == 2 + 300 // INTERVAL


def test_flapping_queue_switches_once_each_way_at_most() -> None:
    # Pressure and calm alternating every interval: never two pressured intervals in a row.
    flapping = [BUSY, CALM] * 20
    assert set(policies(timeline(spec(calmWindowSeconds=30), flapping))) == {"fcfs"}
    # Under priority, the same flapping never leaves a calm window whole: no switch back.
    result = policies(timeline(spec(calmWindowSeconds=30), [BUSY, BUSY] + flapping))
    changes = sum(1 for a, b in zip(result, result[1:]) if a != b)
    assert changes == 1 and result[-1] == "priority"


@pytest.mark.parametrize("pinned", ["fcfs", "priority"])
def test_a_pinned_policy_is_never_changed(pinned: str) -> None:
    decisions = timeline(spec(pinned), [BUSY] * 5 + [CALM] * 30, start=tuner.TunerState(pinned))
    assert set(policies(decisions)) == {pinned}
    assert {d.reason for d in decisions} == {"Pinned"}


@pytest.mark.parametrize("depths", [[], [float("nan"), 3.0], [-1.0], [float("inf")]])
def test_missing_or_broken_readings_hold_the_policy_and_restart_both_stretches(depths: list[float]) -> None:
    missing = (depths, False)
    # Pressure, a gap, pressure: the gap breaks the run of consecutive pressured intervals.
    assert policies(timeline(spec(), [BUSY, missing, BUSY])) == ["fcfs"] * 3
    # Under priority, a gap holds priority and restarts the calm window.
    decisions = timeline(spec(calmWindowSeconds=30), [BUSY, BUSY, CALM, missing, CALM, CALM, CALM])
    assert policies(decisions) == ["fcfs"] + ["priority"] * 5 + ["fcfs"]
    assert decisions[3].reason == "MetricsMissing"


def test_state_survives_an_operator_restart_through_status() -> None:
    def restarted(policy: str, status: dict[str, Any] | None) -> tuner.TunerState:
        return tuner.initial_state({"spec": spec(policy, calmWindowSeconds=30), "status": status})

    assert restarted("auto", {"effectiveSchedulingPolicy": "priority"}) == tuner.TunerState("priority")
    assert restarted("auto", None) == tuner.TunerState("fcfs")
    assert restarted("priority", {"effectiveSchedulingPolicy": "fcfs"}) == tuner.TunerState("priority")
    # Restarted under priority: the calm window counts from the first calm reading after the restart.
    resumed = timeline(spec(calmWindowSeconds=30), [CALM, CALM, CALM],
                       start=restarted("auto", {"effectiveSchedulingPolicy": "priority"}))
    assert policies(resumed) == ["priority", "priority", "fcfs"]


@pytest.mark.parametrize(("replicas", "enabled", "expected"), [(4, True, False), (3, True, True), (1, False, False)])
def test_can_scale_further(replicas: int, enabled: bool, expected: bool) -> None:
    engine_spec = {**spec(), "replicas": replicas}
    engine_spec["autoscaling"] = {**engine_spec["autoscaling"], "enabled": enabled}
    assert tuner.can_scale_further(engine_spec) is expected


def reading(**pods: tuple[float, float]) -> samples.Reading:
    """pod -> (waiting, observed_at)."""
    return samples.Reading(samples={
        pod: samples.PodSample(pod, kv_cache_usage=0.1, num_waiting=waiting, num_running=1, observed_at=at)
        for pod, (waiting, at) in pods.items()
    })


def test_queue_depths_come_from_fresh_samples_of_every_ready_pod() -> None:
    fresh = reading(a=(3, 100.0), b=(5, 95.0))
    assert tuner.queue_depths(fresh, ["a", "b"], now=100.0, interval_seconds=15) == [3, 5]
    # A pod that is not ready is not counted, even where it was read.
    assert tuner.queue_depths(fresh, ["a"], now=100.0, interval_seconds=15) == [3]
    # A sample older than 3 intervals, a ready pod without a sample, or a failed read: no reading.
    assert tuner.queue_depths(reading(a=(3, 100.0), b=(5, 54.0)), ["a", "b"], now=100.0, interval_seconds=15) == []
    assert tuner.queue_depths(reading(a=(3, 100.0)), ["a", "b"], now=100.0, interval_seconds=15) == []
    failed = samples.Reading(failure=samples.Problem(samples.UNREACHABLE, "down"))
    assert tuner.queue_depths(failed, ["a"], now=100.0, interval_seconds=15) == []
