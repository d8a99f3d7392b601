"""The pure autoscaler over timelines: (t, per-pod samples) in, replicas out."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvpilot.operator import autoscaler, samples

POLICY = autoscaler.Policy(
    min_replicas=1, max_replicas=10, target_kv_cache_usage=0.5, target_queue_depth=5,
    interval_seconds=15, scale_up_stabilization_seconds=0, scale_down_stabilization_seconds=300,
)


def reading(t: float, *pods: tuple[float, ...]) -> samples.Reading:
    """A reading of pods p0, p1, ... with (kv, waiting) or (kv, waiting, running) each, taken at `t`."""
    return samples.Reading(samples={
        f"p{i}": samples.PodSample(f"p{i}", pod[0], pod[1], pod[2] if len(pod) > 2 else 0, t)
        for i, pod in enumerate(pods)
    })


def decide(replicas: int, pods: list[tuple[float, ...]], *, t: float = 0.0, starting: int = 0,
           history: tuple = (), policy: autoscaler.Policy = POLICY) -> autoscaler.Decision:
    return autoscaler.decide(policy, replicas, [f"p{i}" for i in range(len(pods))], starting,
                             reading(t, *pods), history, t)


def replay(policy: autoscaler.Policy, timeline: list[tuple[float, list[tuple[float, float]]]], replicas: int
           ) -> list[int]:
    """The replicas after each step of a timeline whose pods are all ready."""
    history: tuple = ()
    memory = None
    counts = []
    for t, pods in timeline:
        decision = autoscaler.decide(policy, replicas, [f"p{i}" for i in range(len(pods))], 0,
                                     reading(t, *pods), history, t, memory)
        replicas, history, memory = decision.replicas, decision.history, decision.memory
        counts.append(replicas)
    return counts


def spread(demand: float, replicas: int) -> list[tuple[float, float]]:
    """`demand` replicas' worth of KV-cache at target, spread over `replicas` pods."""
    return [(min(1.0, demand * POLICY.target_kv_cache_usage / replicas), 0.0)] * replicas


def closed_loop(policy: autoscaler.Policy, demands: list[float], replicas: int) -> list[int]:
    """Each interval's load spread over the replicas the previous decision left (pods ready at once)."""
    history: tuple = ()
    memory = None
    counts = []
    for step, demand in enumerate(demands):
        t = step * policy.interval_seconds
        pods = spread(demand, replicas)
        decision = autoscaler.decide(policy, replicas, [f"p{i}" for i in range(replicas)], 0,
                                     reading(t, *pods), history, t, memory)
        replicas, history, memory = decision.replicas, decision.history, decision.memory
        counts.append(replicas)
    return counts


def changes(counts: list[int]) -> int:
    return sum(1 for a, b in zip(counts, counts[1:]) if a != b)


def test_saturation_is_the_larger_of_kv_and_queue_per_target() -> None:
    # 0.95 / 0.5 = 1.9 on each of 2 pods: ceil(2 x 1.9) = 4.
    up = decide(2, [(0.95, 0), (0.95, 0)])
    assert (up.replicas, up.reason) == (4, autoscaler.SCALED_UP)
    assert up.load == autoscaler.Load(kv_cache_usage=0.95, queue_depth=0, saturation=1.9, observed_at=0)
    assert "2 -> 4 replicas" in up.message and "KV-cache usage 0.95 (target 0.5)" in up.message
    # The queue dominates: 12 waiting / 5 = 2.4 > 0.1 / 0.5.
    assert decide(1, [(0.1, 12)]).replicas == 3
    # Mixed pods: mean of max(0.4, 0.4)=0.4 and max(1.2, 2.0)=2.0 is 1.2 -> ceil(2.4) = 3.
    assert decide(2, [(0.2, 2), (0.6, 10)]).replicas == 3


WIDE = dataclasses.replace(POLICY, max_replicas=1000)


def sampled(t: float, waiting: float, finished: float | None, running: float = 256) -> samples.PodSample:
    return samples.PodSample("p0", 0.3, waiting, running, t, finished)


def decide_after(before: samples.PodSample, now: samples.PodSample) -> autoscaler.Decision:
    """decide() on one pod, with the previous decision's samples; the KV target at 1, so that the
    arrivals term (40/s in 28/s capacities: 1.4) stays below the queue term."""
    return autoscaler.decide(dataclasses.replace(WIDE, target_kv_cache_usage=1.0), 1, ["p0"], 0, samples.Reading({"p0": now}), (), now.observed_at,
                             autoscaler.Memory({"p0": before}))


def test_arrivals_over_capacity_plus_the_backlog_new_replicas_can_still_help() -> None:
    # Over 15 s the pod finished 420 requests (28/s, its capacity: it has a backlog) while its
    # queue grew by 180 (12/s): 40/s arrive. A replica asked for now is ready in 120 s (none was
    # seen to start yet): the 600 waiting beyond the target will have waited longer than the 60 s
    # drain time by then, so no new replica can help them. In the last 60 s before it is ready,
    # 2400 arrive and the ready replica takes 1680: 720 left, drained in 60 s at 28/s per replica.
    decision = decide_after(sampled(0, 425, 1000), sampled(15, 605, 1420))
    load = decision.load
    assert (load.arrival_rate, load.backlog) == (40, 720)
    assert math.isclose(load.capacity_replicas, (40 + 720 / 60) / 28) and decision.replicas == 2
    assert "40 requests/s arriving and a backlog of 720 when a new replica is ready ask for 1.9" in decision.message
    assert decision.memory.capacity == 28.0 and decision.memory.on_way_since == (15.0,)
    # Where replicas start in 30 s, the backlog waiting now is still young when they are ready:
    # 600 + 30 x 40 - 30 x 28 = 960 left, (40 + 960 / 60) / 28 = 2 replicas.
    fast = autoscaler.decide(dataclasses.replace(WIDE, target_kv_cache_usage=1.0), 1, ["p0"], 0,
                             samples.Reading({"p0": sampled(15, 605, 1420)}), (), 15.0,
                             autoscaler.Memory({"p0": sampled(0, 425, 1000)}, startup_seconds=30))
    assert fast.load.backlog == 960 and math.isclose(fast.load.capacity_replicas, 2.0) and fast.replicas == 2
    # A shrinking backlog on replicas that keep up asks for nothing more.
    assert decide_after(sampled(0, 1000, 1000), sampled(15, 700, 1420)).replicas == 1


TEN = [f"p{i}" for i in range(10)]


def ten(t: float, kv: float, waiting: float, running: float, finished: float) -> dict[str, samples.PodSample]:
    """Ten pods p0..p9 alike."""
    return {pod: samples.PodSample(pod, kv, waiting, running, t, finished) for pod in TEN}


def test_a_step_that_replicas_on_their_way_will_drain_does_not_double_the_fleet() -> None:
    # 10 replicas complete 28/s each (their capacity) while 30/s each arrive (their queues grow by
    # 2/s): a step of 7 %. A replica starts in 60 s. The 300 waiting beyond the targets and the
    # 20/s short for that minute are 1500 requests, drained in 60 s by (300 + 1500 / 60) / 28 =
    # 11.6 replicas: 12, not the 20 of a doubling, nor the 70 of the queue read as a rate.
    memory = autoscaler.Memory(ten(0.0, 0.3, 5, 200, 1000), saturated_finished=420, saturated_seconds=15,
                               startup_seconds=60)
    decision = autoscaler.decide(WIDE, 10, TEN, 0, samples.Reading(ten(15.0, 0.3, 35, 200, 1420)), (), 15.0, memory)
    assert decision.load.backlog == 1500 and decision.replicas == 12
    # The next interval, the queues still growing: the two replicas on their way since t=15 are
    # ready at t=75, 15 s before one asked for now would be. 600 waiting + 60 s x 20/s short -
    # 2 x 15 s x 28/s = 960 left, (300 + 960 / 60) / 28 = 11.3 replicas: no more than the 12.
    later = samples.Reading(ten(30.0, 0.3, 65, 200, 1840))
    again = autoscaler.decide(WIDE, 12, TEN, 2, later, decision.history, 30.0, decision.memory)
    assert again.memory.on_way_since == (15.0, 15.0) and again.load.backlog == 960 and again.replicas == 12


def standing(policy: autoscaler.Policy, waiting: list[float], replicas: int = 10, starting: int = 0
             ) -> list[autoscaler.Decision]:
    """Ten ready pods, each finishing 28/s at its capacity (learnt) as 28/s arrive, with `waiting`
    requests each, one reading per interval; spec.replicas held at `replicas` (a count asked for is
    not applied) with `starting` of them on their way."""
    history: tuple = ()
    memory = autoscaler.Memory(ten(0.0, 0.3, waiting[0], 200, 0), saturated_finished=420, saturated_seconds=15,
                               startup_seconds=60)
    decisions = []
    for step, queue in enumerate(waiting[1:], start=1):
        t = step * policy.interval_seconds
        reading_now = samples.Reading(ten(t, 0.3, queue, 200, 28 * t))
        decision = autoscaler.decide(policy, replicas, TEN, starting, reading_now, history, t, memory)
        history, memory = decision.history, decision.memory
        decisions.append(decision)
    return decisions


def test_a_backlog_that_stands_with_no_replica_on_its_way_raises_the_headroom() -> None:
    # 15 waiting beyond the target at each of 10 replicas, their capacity matching the arrivals:
    # the capacity count asks for (280 + 150 / 60) / 28 = 10.1, within the tolerance (10 %) of the
    # 10 there are. Standing through the scale-down window (300 s, 20 intervals), the backlog
    # raises the headroom by 0.2 a window, 0.01 an interval: 10.1 x 1.1 passes the tolerance.
    decisions = standing(WIDE, [20.0] * 41)
    headroom = [d.memory.headroom for d in decisions]
    assert headroom[:19] == [1.0] * 19 and all(b > a for a, b in zip(headroom[19:], headroom[20:]))
    counts = [d.replicas for d in decisions]
    assert counts.count(10) == 29 and counts[29] == 12
    assert "ask for 11.1 replicas (1.10x headroom: backlogs stood)" in decisions[29].message
    # The same backlog while a replica is on its way: that replica is the answer, not yet tried.
    assert {d.memory.headroom for d in standing(WIDE, [20.0] * 41, replicas=11, starting=1)} == {1.0}
    # Gone, the backlog's headroom relaxes: 0.1 an hour without one (240 intervals).
    learnt = decisions[-1].memory.headroom
    relaxed = standing(WIDE, [20.0] * 41 + [0.0] * 240)
    assert math.isclose(relaxed[-1].memory.headroom, learnt - 0.1)


def test_the_capacity_learnt_under_a_backlog_holds_the_replicas_the_arrivals_need() -> None:
    # Once the backlog is gone the capacity (28/s) is remembered: 20/s on each of 2 pods, with
    # empty queues and little KV (0.1 / 0.5), still needs 40 / 28 = 1.4 -> 2 replicas, not 1.
    calm = samples.Reading({pod: samples.PodSample(pod, 0.1, 0, 20, 30.0, 1025) for pod in ("p0", "p1")})
    pods = {pod: samples.PodSample(pod, 0.1, 0, 20, 15.0, 725) for pod in ("p0", "p1")}
    policy = dataclasses.replace(WIDE, scale_down_stabilization_seconds=0)
    later = autoscaler.decide(policy, 4, ["p0", "p1"], 0, calm, (), 30.0, autoscaler.Memory(pods, 420, 15))
    assert later.memory.capacity == 28.0 and math.isclose(later.load.capacity_replicas, 40 / 28)
    assert later.replicas == 2
    # Without a capacity learnt, KV and queue alone say 1.
    assert autoscaler.decide(policy, 4, ["p0", "p1"], 0, calm, (), 30.0, autoscaler.Memory(pods)).replicas == 1


def test_a_replicas_start_up_time_is_learnt_from_the_pods_seen_starting() -> None:
    # Asked for at t=0, ready at t=90: the start-up the backlog is projected over.
    first = decide(1, [(0.95, 0)], t=0.0)
    assert first.replicas == 2 and first.memory.on_way_since == (0.0,)
    memory = first.memory
    for t in range(15, 90, 15):
        memory = autoscaler.decide(POLICY, 2, ["p0"], 1, reading(t, (0.5, 0)), (), t, memory).memory
    ready = autoscaler.decide(POLICY, 2, ["p0", "p1"], 0, reading(90, (0.5, 0), (0.5, 0)), (), 90.0, memory)
    assert ready.memory.startup_seconds == 90 and ready.memory.on_way_since == ()
    assert autoscaler.Memory().startup == autoscaler.STARTUP_SECONDS
    # A wake from zero is a start too; at zero, what was learnt (start-up, capacity) is kept.
    to_zero = dataclasses.replace(POLICY, min_replicas=0)
    asleep = dataclasses.replace(ready.memory, saturated_finished=420, saturated_seconds=15)
    woken = autoscaler.decide(to_zero, 0, [], 0, samples.Reading(), (), 600.0, asleep, held=3.0)
    assert woken.replicas == 1 and woken.memory.on_way_since == (600.0,)
    assert (woken.memory.startup_seconds, woken.memory.capacity) == (90, 28)
    starting = autoscaler.decide(to_zero, 1, [], 1, samples.Reading(), (), 615.0, woken.memory, held=3.0)
    up = autoscaler.decide(to_zero, 1, ["p0"], 0, reading(660.0, (0.1, 0)), (), 660.0, starting.memory, held=0.0)
    assert up.memory.startup_seconds == 90 * 0.5 + 60 * 0.5


def test_a_replicas_capacity_is_measured_over_every_backlog_not_the_last_interval() -> None:
    # Long requests finish a few at a time: under the same backlog one interval sees 6 finish,
    # the next none, the next 9. The capacity is the totals' ratio, 15 in 45 s, not the last 9/15.
    memory = autoscaler.Memory({"p0": sampled(0, 500, 0)})
    stalled = autoscaler.decide(WIDE, 1, ["p0"], 0, samples.Reading({"p0": sampled(15, 500, 0)}), (), 15.0, memory)
    assert stalled.memory.saturated_seconds == 15 and stalled.memory.capacity is None  # nothing finished yet
    for now, finished in ((15, 6), (30, 6), (45, 15)):
        reading = samples.Reading({"p0": sampled(now, 500, finished)})
        memory = autoscaler.decide(WIDE, 1, ["p0"], 0, reading, (), float(now), memory).memory
    assert memory.saturated_seconds == 45 and math.isclose(memory.capacity, 15 / 45)
    # An interval without a backlog (its queue at the target) measures nothing.
    calm = autoscaler.decide(WIDE, 1, ["p0"], 0, samples.Reading({"p0": sampled(60, 0, 40)}), (), 60.0, memory)
    assert calm.memory.capacity == memory.capacity
    # Beyond the window the old work shrinks in proportion, so a changed workload takes over.
    full = autoscaler.Memory({"p0": sampled(0, 500, 0)}, saturated_finished=3600,
                             saturated_seconds=autoscaler.CAPACITY_WINDOW_SECONDS)
    after = autoscaler.decide(WIDE, 1, ["p0"], 0, samples.Reading({"p0": sampled(360, 500, 36)}), (), 360.0, full)
    assert after.memory.saturated_seconds == autoscaler.CAPACITY_WINDOW_SECONDS
    assert math.isclose(after.memory.capacity, (3600 + 36) / (autoscaler.CAPACITY_WINDOW_SECONDS + 360))


def pod_at(t: float, kv: float, running: float, finished: float, waiting: float = 0) -> samples.PodSample:
    return samples.PodSample("p0", kv, waiting, running, t, finished)


def after_one_interval(before: samples.PodSample, now: samples.PodSample, memory: autoscaler.Memory | None = None,
                       *, replicas: int = 1) -> autoscaler.Decision:
    """decide() on pod p0 at `now`, its last reading `before` (with the rest of `memory`)."""
    memory = dataclasses.replace(memory or autoscaler.Memory(), pods={"p0": before})
    return autoscaler.decide(WIDE, replicas, ["p0"], 0, samples.Reading({"p0": now}), (), now.observed_at, memory)


def test_a_replica_at_its_kv_target_measures_capacity_unless_its_cache_is_full_or_filling() -> None:
    # No queue, KV steady at 0.55 (target 0.5): the 6 finished in 15 s are what it does there.
    steady = after_one_interval(pod_at(0, 0.55, 100, 0), pod_at(15, 0.56, 100, 6))
    assert steady.memory.saturated_seconds == 15 and math.isclose(steady.memory.capacity, 6 / 15)
    # Below the target, nothing: the replica could do more than it shows.
    assert after_one_interval(pod_at(0, 0.4, 100, 0), pod_at(15, 0.4, 100, 6)).memory.saturated_seconds == 0
    # Filling (0.3 -> 0.55): what it finishes was taken in at a lighter load. Full (0.96), even
    # with a queue: it preempts. Neither changes what was learnt.
    learnt = autoscaler.Memory(saturated_finished=40, saturated_seconds=100)
    for before, now in [(pod_at(0, 0.3, 100, 0), pod_at(15, 0.55, 160, 1)),
                        (pod_at(0, 0.96, 200, 0, 30), pod_at(15, 0.96, 200, 1, 40))]:
        kept = after_one_interval(before, now, learnt).memory
        assert (kept.saturated_finished, kept.saturated_seconds) == (40, 100)


def test_arrivals_admitted_into_running_count_even_where_nothing_finished() -> None:
    # Long requests, a replica with room: 30 more running, none waiting, none finished in 15 s.
    # 2 a second arrive; at a capacity of 0.4 a replica that is 5 replicas' worth.
    learnt = autoscaler.Memory(saturated_finished=40, saturated_seconds=100)
    decision = after_one_interval(pod_at(0, 0.2, 50, 10), pod_at(15, 0.3, 80, 10), learnt)
    assert decision.load.arrival_rate == 2 and math.isclose(decision.load.capacity_replicas, 5)
    assert decision.replicas == 5


def test_arrivals_are_the_mean_of_the_last_two_intervals() -> None:
    # 14 a second this interval, 10 the one before: a burst of one interval counts half.
    learnt = autoscaler.Memory(saturated_finished=40, saturated_seconds=100, arrival_rate=10)
    decision = after_one_interval(pod_at(0, 0.2, 50, 0), pod_at(15, 0.2, 50, 210), learnt)
    assert decision.load.arrival_rate == 12 and decision.memory.arrival_rate == 14
    # Without the one before (a first reading), this interval alone.
    first = after_one_interval(pod_at(0, 0.2, 50, 0), pod_at(15, 0.2, 50, 210),
                               dataclasses.replace(learnt, arrival_rate=None))
    assert first.load.arrival_rate == 14


def test_a_step_that_fits_in_the_free_kv_of_ready_replicas_asks_for_no_backlog() -> None:
    # 10 replicas of long requests, each running 100 at KV 0.4 without a queue, capacity 0.4 a
    # second: 10 a second arrive (each finished 1.5 and runs 13.5 more). Before a replica asked for
    # now is ready (in 60 s), 600 arrive; the ready ones admit 1,500 more at their footprint
    # (10 x 100 x 0.6 / 0.4): no backlog, and 10 / 0.4 = 25 replicas, where the 600 read as a
    # backlog drained over 60 s would add 25 more.
    memory = autoscaler.Memory(ten(0.0, 0.35, 0, 86.5, 1000), saturated_finished=40, saturated_seconds=100,
                               startup_seconds=60)
    decision = autoscaler.decide(WIDE, 10, TEN, 0, samples.Reading(ten(15.0, 0.4, 0, 100, 1001.5)), (), 15.0, memory)
    assert decision.load.arrival_rate == 10 and decision.load.backlog == 0 and decision.replicas == 25
    # The same replicas with their KV caches nearly full admit 75 between them, and the rest waits.
    full = samples.Reading(ten(15.0, 0.93, 0, 100, 1001.5))
    crowded = autoscaler.decide(WIDE, 10, TEN, 0, full, (), 15.0, memory)
    assert crowded.load.backlog > 0 and crowded.replicas > 25


def test_without_a_completion_rate_a_backlog_is_read_in_batches() -> None:
    # No previous reading, no counter, nothing finished, a counter that went back (a restart):
    # the 995 beyond the target are 995/256 batches of what the pod runs: 1 + 995/256 -> 5.
    for before, now in [(None, sampled(15, 1000, 1420)), (sampled(0, 820, None), sampled(15, 1000, None)),
                        (sampled(0, 820, 1420), sampled(15, 1000, 1420)),
                        (sampled(0, 820, 5000), sampled(15, 1000, 20))]:
        memory = autoscaler.Memory({"p0": before}) if before is not None else None
        decision = autoscaler.decide(WIDE, 1, ["p0"], 0, samples.Reading({"p0": now}), (), 15.0, memory)
        assert decision.replicas == 5 and math.isclose(decision.load.saturation, 1 + 995 / 256)


def test_a_backlog_is_read_in_batches_of_what_replicas_run() -> None:
    wide = WIDE
    # Without rates: 10 replicas running 256 each, 100 waiting each: the 95 beyond the target
    # of 5 fit in 95/256 of a batch: 10 x (1 + 95/256) = 13.7 -> 14. Read as a rate (100 / 5 per
    # replica) it would be 200, which doubling would cap at 20 now and reach within three intervals.
    backlog = decide(10, [(0.3, 100, 256)] * 10, policy=wide)
    assert backlog.replicas == 14
    assert math.isclose(backlog.load.saturation, 1 + 95 / 256)
    # A thousand waiting on one replica running 256 (a flash crowd's first interval): 1 + 995/256
    # = 4.9 -> 5 replicas, which take the thousand into their batches; not maxReplicas.
    assert decide(1, [(0.3, 1000, 256)], policy=wide).replicas == 5
    # Up to the target the queue reads as before, whatever runs: 4 waiting of 5 on 256 running.
    assert math.isclose(decide(2, [(0.0, 4, 256)] * 2).load.saturation, 0.8)
    # A batch smaller than the target counts as the target: the rate reading of before.
    assert decide(1, [(0.0, 12, 2)]).replicas == decide(1, [(0.0, 12, 0)]).replicas == 3


def test_a_draining_backlog_climbs_no_further() -> None:
    # Without rates. A Service does not move queued requests: the backlog drains on the replica
    # that holds it (20 a second here) while the 4 added replicas take new arrivals (0.3 / 0.5 = 0.6 each).
    # At t=15 the 700 left still read as 1 + 695/256 batches: 3.7 + 4 x 0.6 = 6.1 -> 7 (read as
    # a rate: 140 + 2.4, doubling to 10, then to maxReplicas). It never climbs after that; once
    # the backlog drains, the window lets the count down to what the load needs, never up again.
    wide = WIDE
    timeline = [(0, [(0.3, 1000, 256)])]
    timeline += [(t, [(0.3, max(0, 1000 - 20 * t), 256)] + [(0.3, 0, 100)] * 4) for t in range(15, 600, 15)]
    counts = replay(wide, timeline, replicas=1)
    assert counts[:2] == [5, 7] and max(counts) == 7
    assert counts[1:] == sorted(counts[1:], reverse=True) and counts[-1] == 3


@pytest.mark.parametrize(("kv", "expected"), [
    (0.5 * 1.09, 4), (0.5 * 0.91, 4),  # within 10 % of the target: hold
    (0.5 * 1.15, 5), (0.5 * 0.85, 4),  # outside: up at once; down only after the window
])
def test_tolerance_band(kv: float, expected: int) -> None:
    assert decide(4, [(kv, 0)] * 4).replicas == expected


def test_scale_down_outside_the_band_after_the_window() -> None:
    low = [(0.5 * 0.7, 0)] * 4  # saturation 0.7: ceil(2.8) = 3
    timeline = [(t, low) for t in range(0, 331, 15)]
    counts = replay(POLICY, timeline, replicas=4)
    # Every recommendation since the autoscaler began was 3, but what it recommended before it
    # began (a restarted operator) is unknown: the 4 hold for one whole window, then down.
    first_down = next(i for i, c in enumerate(counts) if c < 4)
    assert timeline[first_down][0] == POLICY.scale_down_stabilization_seconds
    assert counts[first_down:] == [3] * (len(counts) - first_down)


def test_a_restarted_autoscaler_does_not_cut_the_scale_down_window_short() -> None:
    # The engine was busy until a minute ago (4 recommended at t=240); the operator restarts at
    # t=300, and its first reading is low. Without the memory lost at the restart, the replicas
    # would hold until t=540: so they hold until t=600, one window after the restart.
    idle = [(0.0, 0)] * 4
    counts = replay(POLICY, [(t, idle) for t in range(300, 631, 15)], replicas=4)
    assert counts[:20] == [4] * 20 and counts[20:] == [1, 1, 1]
    # Scaling up needs no memory: it is at once, from the first reading.
    assert replay(POLICY, [(300, [(1.0, 0)] * 4)], replicas=4) == [8]


def test_scale_down_waits_for_the_highest_recommendation_in_the_window() -> None:
    high, low = [(0.5, 0)] * 4, [(0.05, 0)] * 4
    timeline = [(0, high), *((t, low) for t in range(15, 600, 15))]
    counts = replay(POLICY, timeline, replicas=4)
    # The in-band recommendation at t=0 (4) holds until it leaves the 300 s window; then one step.
    first_down = next(i for i, c in enumerate(counts) if c < 4)
    assert timeline[first_down][0] == 315
    assert counts[first_down] == 1
    assert changes(counts) == 1


def test_brief_dip_is_no_scale_down() -> None:
    busy, idle = [(0.5, 0)] * 3, [(0.0, 0)] * 3
    timeline = [(t, idle if 60 <= t < 120 else busy) for t in range(0, 400, 15)]
    assert replay(POLICY, timeline, replicas=3) == [3] * len(timeline)


def test_scale_up_goes_to_the_recommendation_at_once() -> None:
    # No fixed step: 1 + 95/20 batches of 20 waiting beyond the target on one replica -> 6.
    assert decide(1, [(0.1, 100, 20)]).replicas == 6


def test_bounds_and_scaling_limited() -> None:
    at_max = decide(10, [(1.0, 0)] * 10)
    assert at_max.replicas == 10 and at_max.reason == ""
    limited = {c.type: c for c in at_max.conditions}[autoscaler.SCALING_LIMITED]
    assert (limited.status, limited.reason) == (True, "TooManyReplicas")
    assert "asks for 20 replicas; maxReplicas is 10" in limited.message
    near = decide(8, [(1.0, 0)] * 8)
    assert near.replicas == 10  # 16 clamped
    assert {c.type: c.status for c in near.conditions}[autoscaler.SCALING_LIMITED] is True
    calm = decide(3, [(0.5, 0)] * 3)
    assert {c.type: c.status for c in calm.conditions} == {
        autoscaler.METRICS_AVAILABLE: True, autoscaler.SCALING_LIMITED: False}
    # Idle goes down to minReplicas, never below; scale-down stabilization 0 for brevity.
    policy = dataclasses.replace(POLICY, min_replicas=2, scale_down_stabilization_seconds=0)
    assert decide(5, [(0.0, 0)] * 5, policy=policy).replicas == 2


def test_starting_pods_count_as_capacity_on_its_way() -> None:
    # 2 -> 4 for a burst; the 2 new pods start while the old ones still carry the burst.
    first = decide(2, [(0.95, 0)] * 2)
    assert first.replicas == 4
    again = decide(4, [(0.95, 0)] * 2, starting=2, t=15, history=first.history)
    assert again.replicas == 4 and again.reason == ""


def test_scale_up_stabilization_takes_the_lowest_recommendation_of_its_window() -> None:
    policy = dataclasses.replace(POLICY, scale_up_stabilization_seconds=30)
    high = [(1.0, 0)] * 2  # asks for 4
    counts = replay(policy, [(0, [(0.5, 0)] * 2), (15, high), (30, high), (45, high)], replicas=2)
    assert counts == [2, 2, 2, 4]


def reversals(counts: list[int]) -> int:
    """How often the count turned from going up to going down, or back."""
    moves = [b - a for a, b in zip(counts, counts[1:]) if a != b]
    return sum(1 for a, b in zip(moves, moves[1:]) if (a > 0) != (b > 0))


def test_flapping_load_does_not_oscillate() -> None:
    # Demand swings between 1 and 6 replicas' worth every interval, for half an hour. (One
    # replica's KV cache holds at most twice its target, so the climb takes three doublings.)
    demands = [6.0 if step % 2 else 1.0 for step in range(120)]
    counts = closed_loop(POLICY, demands, replicas=1)
    assert counts[:6] == [1, 2, 2, 4, 4, 6]
    assert counts[6:] == [6] * 114, "no scale-down while the peaks keep coming"
    # Swings of 5 minutes each way never outlast the scale-down window: it stays up.
    demands = [6.0 if (step // 20) % 2 else 1.0 for step in range(120)]
    counts = closed_loop(POLICY, demands, replicas=1)
    assert counts[23:] == [6] * 97 and reversals(counts) == 0
    # Swings of 10 minutes: down once per calm phase, one window after it began, and up again.
    demands = [6.0 if (step // 40) % 2 else 1.0 for step in range(160)]
    counts = closed_loop(POLICY, demands, replicas=1)
    assert counts[80:120] == [6] * 20 + [1] * 20
    assert reversals(counts) == 2 and changes(counts) == 7


def test_load_that_grows_then_ends_settles_at_min() -> None:
    demands = [1, 2, 4, 8, 8, 8] + [0] * 30
    counts = closed_loop(POLICY, [float(d) for d in demands], replicas=1)
    assert counts[5] == 8
    assert counts[-1] == 1
    assert counts == sorted(counts[:6]) + counts[6:]  # only up while the load grows


@pytest.mark.parametrize(("read", "reason", "words"), [
    (samples.Reading(failure=samples.Problem(samples.UNREACHABLE, "http://prom: refused")),
     samples.UNREACHABLE, "refused"),
    (samples.Reading(samples={"p0": samples.PodSample("p0", 0.9, 0, 0, 100.0)},
                     problems={"p1": samples.Problem(samples.INVALID, "pod p1 reports x = nan")}),
     samples.INVALID, "pod p1 reports x = nan"),
    (samples.Reading(samples={"p0": samples.PodSample("p0", 0.9, 0, 0, 100.0)}),
     samples.MISSING, "no sample of pod p1"),
    (samples.Reading(samples={"p0": samples.PodSample("p0", 0.9, 0, 0, 100.0),
                              "p1": samples.PodSample("p1", 0.9, 0, 0, 100.0 - 46)}),
     samples.STALE, "pod p1's last sample is 46s old"),
])
def test_bad_metrics_hold_the_count_and_say_why(read: samples.Reading, reason: str, words: str) -> None:
    history = ((90.0, 2),)
    decision = autoscaler.decide(POLICY, 2, ["p0", "p1"], 0, read, history, 100.0)
    assert (decision.replicas, decision.reason, decision.load, decision.history) == (2, "", None, history)
    (available,) = decision.conditions
    assert (available.type, available.status, available.reason) == (autoscaler.METRICS_AVAILABLE, False, reason)
    assert words in available.message


@pytest.mark.parametrize(("replicas", "bounded", "reason"), [(1, 2, "ScaledUp"), (9, 4, "ScaledDown")])
def test_replicas_outside_the_bounds_are_brought_within_them_even_without_metrics(
    replicas: int, bounded: int, reason: str
) -> None:
    # Autoscaling just turned on with minReplicas 2 over the default 1 replica, or maxReplicas
    # lowered to 4 under 9: the bounds are the spec's, not a reading's, so they hold with none.
    policy = dataclasses.replace(POLICY, min_replicas=2, max_replicas=4)
    unreachable = samples.Reading(failure=samples.Problem(samples.UNREACHABLE, "http://prom: refused"))
    held = autoscaler.decide(policy, replicas, ["p0"], 0, unreachable, (), 100.0)
    assert (held.replicas, held.reason) == (bounded, reason)
    assert held.message == f"{replicas} -> {bounded} replicas: within minReplicas 2 and maxReplicas 4"
    assert held.conditions[0].status is False and held.conditions[0].reason == samples.UNREACHABLE
    # With metrics, too, and at once: even a scale-down needs no window to reach maxReplicas.
    idle = autoscaler.decide(policy, replicas, ["p0"], 0, reading(100.0, (0.0, 0)), (), 100.0)
    assert (idle.replicas, idle.reason) == (bounded, reason)


def test_stale_is_older_than_three_intervals() -> None:
    fresh = samples.Reading(samples={"p0": samples.PodSample("p0", 0.5, 0, 0, 100.0 - 45)})
    assert autoscaler.decide(POLICY, 1, ["p0"], 0, fresh, (), 100.0).conditions[0].status is True


def test_no_ready_pod_is_missing_metrics() -> None:
    decision = autoscaler.decide(POLICY, 2, [], 2, samples.Reading(), (), 0.0)
    assert decision.replicas == 2
    assert decision.conditions[0].reason == samples.MISSING
    assert "no replica is ready to be read (2 starting)" in decision.conditions[0].message


def test_many_bad_pods_are_named_up_to_five() -> None:
    names = [f"p{i}" for i in range(8)]
    decision = autoscaler.decide(POLICY, 8, names, 0, samples.Reading(), (), 0.0)
    assert decision.conditions[0].message.endswith("no sample of pod p4; and 3 more")


def test_samples_of_pods_that_are_not_ready_are_ignored() -> None:
    read = reading(0, (0.5, 0), (1.0, 50))  # p1 is not ready: its reading does not count
    decision = autoscaler.decide(POLICY, 2, ["p0"], 1, read, (), 0)
    assert decision.replicas == 2 and math.isclose(decision.load.saturation, 1.0)


TARGETED = dataclasses.replace(POLICY, target_ttft_seconds=1.0)
BOUNDS = (0.5, 1.0, 2.5, math.inf)


def buckets(*counts: float) -> samples.Buckets:
    """Cumulative counts at BOUNDS."""
    return tuple(zip(BOUNDS, counts))


def test_the_latency_quantile_is_read_from_the_buckets_filled_in_between() -> None:
    # 100 requests in the interval: 50 within 0.5 s, 30 more within 1 s, 20 more within 2.5 s. The
    # 90th is the 10th of the 20 in (1, 2.5]: 1 + 1.5 x 10/20 = 1.75 s.
    assert autoscaler.quantile(0.9, buckets(70, 110, 130, 130), buckets(20, 30, 30, 30)) == 1.75
    # Beyond the largest finite bound: that bound, as PromQL's histogram_quantile says.
    assert autoscaler.quantile(0.9, buckets(0, 0, 0, 20), buckets(0, 0, 0, 0)) == 2.5
    # Too few to say, a restarted engine (counts went back), other bounds: nothing.
    assert autoscaler.quantile(0.9, buckets(5, 5, 5, 5), buckets(0, 0, 0, 0)) is None
    assert autoscaler.quantile(0.9, buckets(0, 0, 0, 20), buckets(0, 0, 0, 40)) is None
    assert autoscaler.quantile(0.9, buckets(0, 0, 0, 20)[1:], buckets(0, 0, 0, 0)[1:] + ((9.0, 0),)) is None


def test_a_ttft_breach_at_normal_kv_and_queue_levels_scales_up() -> None:
    # Both pods at 0.3 KV (0.6 of the target) with 2 waiting (0.4): calm by those. Their p90 TTFT
    # over the interval is 1.75 s against a 1 s target: each counts 1.75 busy, 2 x 1.75 -> 4.
    before = {pod: samples.PodSample(pod, 0.3, 2, 10, 0.0, 0, buckets(20, 30, 30, 30)) for pod in ("p0", "p1")}
    now = {pod: samples.PodSample(pod, 0.3, 2, 10, 15.0, 100, buckets(70, 110, 130, 130)) for pod in ("p0", "p1")}
    decision = autoscaler.decide(TARGETED, 2, ["p0", "p1"], 0, samples.Reading(now), (), 15.0,
                                 autoscaler.Memory(before))
    assert math.isclose(decision.load.saturation, 1.75) and decision.replicas == 4
    assert decision.conditions[0] == autoscaler.Condition(
        autoscaler.METRICS_AVAILABLE, True, "MetricsRead", "read 2 ready replicas")
    # The same reading without the target: 2 hold.
    assert autoscaler.decide(POLICY, 2, ["p0", "p1"], 0, samples.Reading(now), (), 15.0,
                             autoscaler.Memory(before)).replicas == 2


def test_missing_latency_histograms_leave_kv_and_queue_in_charge_with_a_reason() -> None:
    # A TTFT target, and engines that export no histogram: KV (0.95 / 0.5) decides, as without
    # a target, and MetricsAvailable says why the target is not read.
    decision = autoscaler.decide(TARGETED, 2, ["p0", "p1"], 0, reading(15.0, (0.95, 0), (0.95, 0)), (), 15.0)
    assert decision.replicas == 4
    available = decision.conditions[0]
    assert (available.type, available.status, available.reason) == (
        autoscaler.METRICS_AVAILABLE, True, autoscaler.LATENCY_MISSING)
    assert available.message == ("pod p0 reports no vllm:time_to_first_token_seconds; pod p1 reports no"
                                 " vllm:time_to_first_token_seconds: KV-cache usage and queue depth decide alone")


def test_a_starting_pod_is_never_chosen_for_removal() -> None:
    policy = dataclasses.replace(POLICY, scale_down_stabilization_seconds=0)
    idle = samples.Reading({"p0": samples.PodSample("p0", 0.0, 0, 3, 0.0),
                            "p1": samples.PodSample("p1", 0.0, 0, 0, 0.0),
                            "p2": samples.PodSample("p2", 0.0, 1, 0, 0.0)})
    # The load asks for 1. A ReplicaSet deletes unready pods first, so while one starts the count
    # stays at the pods ready and starting.
    starting = autoscaler.decide(policy, 4, ["p0", "p1", "p2"], 1, idle, (), 0.0)
    assert (starting.replicas, starting.remove) == (4, ())
    # Pods asked for but not created yet may go; the starting one stays.
    uncreated = autoscaler.decide(policy, 6, ["p0", "p1", "p2"], 1, idle, (), 0.0)
    assert (uncreated.replicas, uncreated.remove) == (4, ())
    # Once none starts: down to 1, the least loaded first (p1 runs nothing, p2 has one waiting).
    ready = autoscaler.decide(policy, 3, ["p0", "p1", "p2"], 0, idle, (), 0.0)
    assert (ready.replicas, ready.reason, ready.remove) == (1, autoscaler.SCALED_DOWN, ("p1", "p2"))
