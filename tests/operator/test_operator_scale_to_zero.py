"""Scale to zero and back, in the pure autoscaler, over recorded timelines: minReplicas 0 with
the routers' held requests as the load at zero."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvpilot.operator import autoscaler, samples

POLICY = autoscaler.Policy(
    min_replicas=0, max_replicas=4, target_kv_cache_usage=0.8, target_queue_depth=5, interval_seconds=15,
    scale_up_stabilization_seconds=0, scale_down_stabilization_seconds=300, scale_to_zero_after_seconds=60,
)
UNREACHABLE = samples.Problem(samples.MISSING, "router pod r0: GET /metrics failed")


@dataclass(frozen=True)
class Moment:
    """One interval's reading: (kv, waiting, running) per ready pod, pods starting, requests held."""

    t: float
    pods: tuple[tuple[float, float, float], ...] = ()
    starting: int = 0
    held: float | samples.Problem = 0.0


def replay(timeline: list[Moment], replicas: int, policy: autoscaler.Policy = POLICY
           ) -> list[autoscaler.Decision]:
    history: tuple = ()
    memory = None
    decisions = []
    for moment in timeline:
        names = [f"p{i}" for i in range(len(moment.pods))]
        reading = samples.Reading(samples={
            name: samples.PodSample(name, kv, waiting, running, moment.t)
            for name, (kv, waiting, running) in zip(names, moment.pods)
        })
        decision = autoscaler.decide(policy, replicas, names, moment.starting, reading, history, moment.t, memory,
                                     held=moment.held)
        replicas, history, memory = decision.replicas, decision.history, decision.memory
        decisions.append(decision)
    return decisions


IDLE = ((0.0, 0.0, 0.0),)
BUSY = ((0.3, 0.0, 2.0),)


def test_idle_past_the_window_goes_to_zero() -> None:
    decisions = replay([Moment(t, IDLE) for t in (0, 15, 30, 45, 60)], replicas=1)
    assert [d.replicas for d in decisions] == [1, 1, 1, 1, 0]
    last = decisions[-1]
    assert last.reason == autoscaler.SCALED_DOWN
    assert "idle for 60s" in last.message and "no request running, waiting or held" in last.message


def test_any_work_restarts_the_idle_window() -> None:
    timeline = [Moment(0, IDLE), Moment(15, IDLE), Moment(30, BUSY), Moment(45, IDLE), Moment(60, IDLE),
                Moment(90, IDLE), Moment(105, IDLE)]
    assert [d.replicas for d in replay(timeline, replicas=1)] == [1, 1, 1, 1, 1, 1, 0]


def test_a_held_request_is_work() -> None:
    timeline = [Moment(t, IDLE, held=1.0 if t == 30 else 0.0) for t in (0, 15, 30, 45, 60, 75, 90)]
    assert [d.replicas for d in replay(timeline, replicas=1)] == [1, 1, 1, 1, 1, 1, 1]


def test_a_starting_pod_is_never_scaled_away() -> None:
    # One replica idle, a second one still loading its weights: never 0 while it starts.
    timeline = [Moment(t, IDLE, starting=1) for t in (0, 15, 30, 45, 60, 75)]
    assert all(d.replicas == 2 for d in replay(timeline, replicas=2))


def test_an_unknown_held_count_is_not_idle() -> None:
    # Idle again from 60 on, after the reading that could not tell.
    timeline = [Moment(t, IDLE, held=UNREACHABLE if t == 45 else 0.0) for t in range(0, 121, 15)]
    assert [d.replicas for d in replay(timeline, replicas=1)] == [1] * 8 + [0]


def test_the_load_alone_never_asks_for_zero() -> None:
    # Saturation 0 would be ceil(0) replicas; only the idle window takes the engine to 0.
    (decision,) = replay([Moment(0, IDLE * 3)], replicas=3)
    assert decision.replicas == 3  # the scale-down window has not passed since the memory began
    decisions = replay([Moment(t, IDLE * 3) for t in range(0, 301, 15)],
                       replicas=3, policy=dataclasses.replace(POLICY, scale_to_zero_after_seconds=3600))
    assert decisions[-1].replicas == 1


def test_held_requests_at_zero_scale_up_at_once() -> None:
    (decision,) = replay([Moment(0, held=3.0)], replicas=0)
    assert (decision.replicas, decision.reason) == (1, autoscaler.SCALED_UP)
    assert "the routers hold 3 requests" in decision.message
    assert decision.conditions[0] == autoscaler.Condition(
        autoscaler.METRICS_AVAILABLE, True, "RoutersRead", "the routers hold 3 requests")


def test_held_requests_at_zero_scale_to_min_replicas_when_that_is_more() -> None:
    # Scaled to 0 by hand (kubectl scale) with minReplicas 2: the bounds bring it up anyway.
    policy = dataclasses.replace(POLICY, min_replicas=2)
    (decision,) = replay([Moment(0, held=1.0)], replicas=0, policy=policy)
    assert decision.replicas == 2


def test_nothing_held_at_zero_stays_at_zero() -> None:
    decisions = replay([Moment(t) for t in (0, 15, 30)], replicas=0)
    assert [d.replicas for d in decisions] == [0, 0, 0]
    assert all(d.conditions[0].status for d in decisions)


def test_unreadable_routers_at_zero_change_nothing_and_say_why() -> None:
    (decision,) = replay([Moment(0, held=UNREACHABLE)], replicas=0)
    assert (decision.replicas, decision.reason) == (0, "")
    assert decision.conditions == (autoscaler.Condition(
        autoscaler.METRICS_AVAILABLE, False, samples.MISSING, UNREACHABLE.message),)


def test_zero_and_back_over_a_day() -> None:
    # Traffic, an idle hour, a first request (held at 0), the replica starting, serving, idle again.
    timeline = [
        Moment(0, BUSY), Moment(15, IDLE), Moment(30, IDLE), Moment(45, IDLE), Moment(60, IDLE),
        Moment(75, IDLE),  # -> 0
        Moment(90), Moment(3600),  # nothing runs, nothing held
        Moment(3615, held=1.0),  # -> 1 at once
        Moment(3630, starting=1, held=1.0), Moment(3645, starting=1, held=1.0),  # loading: held, no change
        Moment(3660, BUSY), Moment(3675, IDLE), Moment(3735, IDLE),  # -> 0 again
    ]
    assert [d.replicas for d in replay(timeline, replicas=1)] == [1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1, 0]
