"""The autoscaler: a window of per-pod samples -> desired replicas. Pure: no I/O, the clock is a
parameter, and what it remembers between intervals (its recent recommendations, the last
reading and a replica's capacity) goes in and comes out as a value.

- Per ready replica, saturation = the largest of three terms, in replicas at target:
  KV: kv / targetKVCacheUsage.
  Queue: waiting / targetQueueDepth up to the target (1). Beyond it the excess is a backlog (a
  stock, not a rate) that drains where it waits: at the replica's completion rate (its
  vllm:request_success_total since the previous reading) less the arrivals still routed to it.
  To drain it within BACKLOG_DRAIN_SECONDS those must shrink to completed - excess / horizon:
  the term is arrived / that. Where the rates are unknown, the excess is read in batches of what
  the replica runs (num_requests_running, at least targetQueueDepth). Read as a rate, as the HPA
  reads an average value, a backlog would ask for one replica per targetQueueDepth requests.
  Arrivals: arrived / (capacity x targetKVCacheUsage), with capacity what a replica completes
  per second while it has a backlog, measured over every backlog seen (Memory.capacity) and kept
  in the decision's Memory: it holds the replicas the traffic needs when the queues are empty
  and KV usage lags.
- The recommendation is ceil(ready x mean saturation), unless the mean lies within 10 % of 1.
- Scaling up takes the lowest recommendation of the last scaleUpStabilizationSeconds (0: the
  current one), and at most doubles the count (or adds 4, whichever is more) per decision;
  replicas still starting count as capacity already on its way.
- ScalingLimited is True while the load asks for more than maxReplicas.
- Scaling down takes the highest recommendation of the last scaleDownStabilizationSeconds, and
  waits for that window to have passed since the autoscaler's memory began (as the HPA does).
- The result lies within [minReplicas, maxReplicas], even where spec.replicas does not (the CRD
  accepts any count, as the HPA's target does).
- Missing, stale or invalid metrics hold the count (within the bounds) and say why in
  MetricsAvailable.

Scale to zero (minReplicas 0, which the CRD allows only with routing): the load never asks for
fewer than one replica; the engine goes to 0 only once it has been idle for
scaleToZeroAfterSeconds: every ready replica with nothing running or waiting, the routers holding
nothing, and no replica starting (a starting pod is never scaled away). At 0 replicas, requests
held by the routers scale it to max(1, minReplicas) at once.

Why no request is lost in the race between reading the held count and writing 0 replicas: a
request that reaches a router after the reading finds either a replica still ready (it runs
there, and the replica's drain on SIGTERM lets it finish), or none (the routers take a replica
out as soon as its endpoint stops being ready, and retry a request refused before its first
byte): then the router holds it, and the next interval reads it held and scales up. A held
request waits up to routing.holdTimeoutSeconds, then gets a 503 with Retry-After: never lost,
but the hold timeout should outlast an interval plus an engine's start.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpilot.operator import samples

TOLERANCE = 0.1
# How soon a backlog beyond targetQueueDepth should be gone: within a client's patience.
BACKLOG_DRAIN_SECONDS = 60.0
# A backlog too large to drain within that even with no arrivals asks to spread them this thin.
MAX_SPREAD = 2.0
# The replica-seconds of backlog a replica's capacity is measured over (Memory.capacity): an
# hour of one replica's, or a few minutes of a fleet's; older ones weigh less.
CAPACITY_WINDOW_SECONDS = 3600.0
# A sample older than this many intervals is stale.
STALE_INTERVALS = 3
SCALE_UP_FACTOR = 2
SCALE_UP_STEP = 4
# Pods named in a condition message before the rest are counted.
_NAMED_PODS = 5

METRICS_AVAILABLE = "MetricsAvailable"
SCALING_LIMITED = "ScalingLimited"
SCALED_UP = "ScaledUp"
SCALED_DOWN = "ScaledDown"

# The order in which a reading's problems are reported, the worst first.
_PROBLEM_ORDER = (samples.UNREACHABLE, samples.INVALID, samples.MISSING, samples.STALE)


@dataclass(frozen=True)
class Policy:
    min_replicas: int
    max_replicas: int
    target_kv_cache_usage: float
    target_queue_depth: float
    interval_seconds: float
    scale_up_stabilization_seconds: float
    scale_down_stabilization_seconds: float
    scale_to_zero_after_seconds: float = 300.0

    @classmethod
    def from_spec(cls, autoscaling: Mapping[str, Any]) -> Policy:
        """From spec.autoscaling as the API server serves it (the CRD's defaults applied)."""
        return cls(
            min_replicas=autoscaling["minReplicas"],
            max_replicas=autoscaling["maxReplicas"],
            target_kv_cache_usage=autoscaling["targetKVCacheUsage"],
            target_queue_depth=autoscaling["targetQueueDepth"],
            interval_seconds=autoscaling["intervalSeconds"],
            scale_up_stabilization_seconds=autoscaling["scaleUpStabilizationSeconds"],
            scale_down_stabilization_seconds=autoscaling["scaleDownStabilizationSeconds"],
            scale_to_zero_after_seconds=autoscaling["scaleToZeroAfterSeconds"],
        )

    @property
    def floor(self) -> int:
        """The fewest replicas a load asks for: 0 comes from idleness alone."""
        return max(1, self.min_replicas)


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str


@dataclass(frozen=True)
class Load:
    """The ready replicas' reading, averaged over them."""

    kv_cache_usage: float
    queue_depth: float  # waiting requests per replica
    saturation: float
    observed_at: float  # the oldest sample's time


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str  # SCALED_UP, SCALED_DOWN, or "" when the count stays
    message: str
    conditions: tuple[Condition, ...]
    load: Load | None  # None when the metrics could not be used
    # (time, recommendation) pairs inside the stabilization windows: the next call's `history`.
    history: tuple[tuple[float, int], ...]
    memory: Memory = field(default_factory=lambda: Memory())  # the next call's `memory`


@dataclass(frozen=True)
class Memory:
    """What one reading leaves for the next: the pods' samples, for their rates since; the
    requests replicas finished while they had a backlog and the replica-seconds that took (see
    `capacity`); when the memory began (None: it begins with this reading); and since when the
    engine has been idle, without a break (None: it is not)."""

    pods: Mapping[str, samples.PodSample] = field(default_factory=dict)
    backlog_finished: float = 0.0
    backlog_seconds: float = 0.0
    since: float | None = None
    idle_since: float | None = None

    @property
    def capacity(self) -> float | None:
        """What a replica completes per second while it has a backlog; None until one was seen
        to finish anything. One interval's count is noise for long requests (a replica finishes
        a few, or none, in 15 s), so it is the ratio of the totals over CAPACITY_WINDOW_SECONDS
        of backlog."""
        return self.backlog_finished / self.backlog_seconds if self.backlog_finished > 0 else None


def decide(
    policy: Policy,
    replicas: int,
    ready: Sequence[str],
    starting: int,
    reading: samples.Reading,
    history: tuple[tuple[float, int], ...],
    now: float,
    memory: Memory | None = None,
    *,
    held: float | samples.Problem | None = None,
) -> Decision:
    """`replicas` is spec.replicas; `ready` names the ready pods, `starting` counts the pods that
    exist but are not ready yet (terminating ones count in neither). `memory` is the last
    decision's. `held` is what the routers hold, summed (None: the engine has no routers)."""
    memory = memory or Memory()
    since = now if memory.since is None else memory.since
    if replicas == 0 and policy.min_replicas == 0:
        return _at_zero(policy, held, history, Memory(since=since))
    problem = _problem(policy, ready, starting, reading, now)
    if problem is not None:
        # No reading to go by; the bounds are the spec's own, and hold all the same.
        memory = dataclasses.replace(memory, since=since, idle_since=None)
        bounded = _clamp(policy, replicas)
        if bounded == replicas:
            return Decision(replicas, "", problem.message, (problem,), None, history, memory)
        return Decision(bounded, SCALED_UP if bounded > replicas else SCALED_DOWN,
                        f"{replicas} -> {bounded} replicas: within minReplicas {policy.min_replicas}"
                        f" and maxReplicas {policy.max_replicas}", (problem,), None, history, memory)
    used = {pod: reading.samples[pod] for pod in ready}
    rates = {pod: _rates(sample, memory.pods.get(pod)) for pod, sample in used.items()}
    idle = policy.min_replicas == 0 and _idle(used, starting, held)
    idle_since = (now if memory.idle_since is None else memory.idle_since) if idle else None
    memory = Memory(used, *_backlog_work(policy, used, memory), since=since, idle_since=idle_since)
    load = _load(policy, used, rates, memory.capacity)

    # In replicas at target: what the ready replicas carry now. Starting replicas are in
    # `replicas` already, so the capacity on its way is never asked for twice.
    wanted = replicas if abs(load.saturation - 1) <= TOLERANCE else math.ceil(len(ready) * load.saturation - 1e-9)
    recommendation = _clamp(policy, wanted)

    window = max(policy.scale_up_stabilization_seconds, policy.scale_down_stabilization_seconds)
    history = (*((t, r) for t, r in history if t >= now - window), (now, recommendation))
    up = min(r for t, r in history if t >= now - policy.scale_up_stabilization_seconds)
    down = max(r for t, r in history if t >= now - policy.scale_down_stabilization_seconds)
    if up > replicas:
        target = min(up, max(replicas * SCALE_UP_FACTOR, replicas + SCALE_UP_STEP))
    elif down < replicas and now - since >= policy.scale_down_stabilization_seconds:
        # Only once the recommendations on record cover the whole window: those from before the
        # memory began (a restarted operator, autoscaling just turned on) are unknown, and the
        # count that runs may rest on them.
        target = down
    else:
        target = replicas
    target = _clamp(policy, target)

    summary = (f"KV-cache usage {load.kv_cache_usage:.2f} (target {policy.target_kv_cache_usage:g}),"
               f" {load.queue_depth:.1f} waiting per replica (target {policy.target_queue_depth:g}),"
               f" saturation {load.saturation:.2f} over {len(ready)} ready and {starting} starting replicas")
    conditions = (
        Condition(METRICS_AVAILABLE, True, "MetricsRead", f"read {len(ready)} ready replicas"),
        _limit(policy, wanted),
    )
    if idle_since is not None and now - idle_since >= policy.scale_to_zero_after_seconds:
        target = 0
        summary = (f"idle for {now - idle_since:.0f}s (scaleToZeroAfterSeconds"
                   f" {policy.scale_to_zero_after_seconds:g}): no request running, waiting or held")
    if target == replicas:
        return Decision(replicas, "", summary, conditions, load, history, memory)
    reason = SCALED_UP if target > replicas else SCALED_DOWN
    return Decision(target, reason, f"{replicas} -> {target} replicas: {summary}", conditions, load, history, memory)


def _at_zero(policy: Policy, held: float | samples.Problem | None, history: tuple[tuple[float, int], ...],
             memory: Memory) -> Decision:
    """No replica runs: the routers' held requests are the only load there is."""
    if held is None:
        held = samples.Problem(samples.MISSING, "the engine has no routers to read")
    if isinstance(held, samples.Problem):
        problem = Condition(METRICS_AVAILABLE, False, held.reason, held.message)
        return Decision(0, "", f"no replica runs, and {held.message}", (problem,), None, history, memory)
    conditions = (Condition(METRICS_AVAILABLE, True, "RoutersRead", f"the routers hold {held:g} requests"),
                  _limit(policy, policy.floor if held else 0))
    if held == 0:
        return Decision(0, "", "no replica runs; the routers hold no request", conditions, None, history, memory)
    return Decision(policy.floor, SCALED_UP,
                    f"0 -> {policy.floor} replicas: the routers hold {held:g} requests and no replica runs",
                    conditions, None, history, memory)


def _idle(used: Mapping[str, samples.PodSample], starting: int, held: float | samples.Problem | None) -> bool:
    """Nothing to serve, nothing on its way: an unknown held count is not idle."""
    if starting or not isinstance(held, float | int) or held > 0:
        return False
    return all(sample.num_running == 0 and sample.num_waiting == 0 for sample in used.values())


def _problem(
    policy: Policy, ready: Sequence[str], starting: int, reading: samples.Reading, now: float
) -> Condition | None:
    """MetricsAvailable=False, with the worst reason found, or None when every ready pod has a
    fresh, valid sample."""
    if reading.failure is not None:
        return Condition(METRICS_AVAILABLE, False, reading.failure.reason, reading.failure.message)
    if not ready:
        return Condition(METRICS_AVAILABLE, False, samples.MISSING,
                         f"no replica is ready to be read ({starting} starting)")
    found: dict[str, list[str]] = {}
    for pod in ready:
        sample = reading.samples.get(pod)
        if pod in reading.problems:
            problem = reading.problems[pod]
            found.setdefault(problem.reason, []).append(problem.message)
        elif sample is None:
            found.setdefault(samples.MISSING, []).append(f"no sample of pod {pod}")
        elif now - sample.observed_at > STALE_INTERVALS * policy.interval_seconds:
            found.setdefault(samples.STALE, []).append(
                f"pod {pod}'s last sample is {now - sample.observed_at:.0f}s old")
    for reason in _PROBLEM_ORDER:
        if reason in found:
            messages = found[reason]
            more = f"; and {len(messages) - _NAMED_PODS} more" if len(messages) > _NAMED_PODS else ""
            return Condition(METRICS_AVAILABLE, False, reason, "; ".join(messages[:_NAMED_PODS]) + more)
    return None


def _backlog_work(policy: Policy, used: Mapping[str, samples.PodSample], memory: Memory) -> tuple[float, float]:
    """Memory's (finished, replica-seconds) under a backlog, with what each pod that has one did
    since its last reading; beyond the window both shrink in proportion, which forgets the oldest."""
    finished, seconds = memory.backlog_finished, memory.backlog_seconds
    for pod, sample in used.items():
        progress = _progress(sample, memory.pods.get(pod))
        if sample.num_waiting > policy.target_queue_depth and progress is not None:
            finished, seconds = finished + progress[1], seconds + progress[0]
    if seconds > CAPACITY_WINDOW_SECONDS:
        finished, seconds = finished * CAPACITY_WINDOW_SECONDS / seconds, CAPACITY_WINDOW_SECONDS
    return finished, seconds


def _progress(sample: samples.PodSample, before: samples.PodSample | None) -> tuple[float, float] | None:
    """(seconds, requests finished) at the pod since `before`; None when unknown (no earlier
    reading, no counter, no time passed, or the counter went back: a restarted engine)."""
    if before is None or sample.num_finished is None or before.num_finished is None:
        return None
    elapsed, done = sample.observed_at - before.observed_at, sample.num_finished - before.num_finished
    return (elapsed, done) if elapsed > 0 and done >= 0 else None


def _rates(sample: samples.PodSample, before: samples.PodSample | None) -> tuple[float, float] | None:
    """(completed, arrived) requests per second at the pod since `before`: from its finished
    counter, and that plus its queue's growth. None when unknown (see _progress) or when nothing
    finished."""
    progress = _progress(sample, before)
    if progress is None or progress[1] == 0:
        return None
    elapsed, done = progress
    completed = done / elapsed
    return completed, max(0.0, completed + (sample.num_waiting - before.num_waiting) / elapsed)


def _queue_term(policy: Policy, sample: samples.PodSample, rates: tuple[float, float] | None) -> float:
    target = policy.target_queue_depth
    excess = sample.num_waiting - target
    if excess <= 0:
        return sample.num_waiting / target
    if rates is None:
        return 1 + excess / max(sample.num_running, target)
    completed, arrived = rates
    # A Service does not move queued requests: the backlog drains where it is, at the completion
    # rate less the arrivals still routed here. Those must shrink to completed - excess / horizon.
    allowed = max(completed - excess / BACKLOG_DRAIN_SECONDS, completed / MAX_SPREAD)
    return max(1.0, arrived / allowed)


def _arrival_term(policy: Policy, rates: tuple[float, float] | None, capacity: float | None) -> float:
    """The pod's arrivals in replicas' capacities, each run at targetKVCacheUsage of what it can do."""
    if rates is None or capacity is None:
        return 0.0
    return rates[1] / (capacity * policy.target_kv_cache_usage)


def _load(policy: Policy, used: Mapping[str, samples.PodSample], rates: Mapping[str, tuple[float, float] | None],
          capacity: float | None) -> Load:
    saturations = [max(s.kv_cache_usage / policy.target_kv_cache_usage, _queue_term(policy, s, rates[pod]),
                       _arrival_term(policy, rates[pod], capacity))
                   for pod, s in used.items()]
    values = used.values()
    return Load(
        kv_cache_usage=sum(s.kv_cache_usage for s in values) / len(used),
        queue_depth=sum(s.num_waiting for s in values) / len(used),
        saturation=sum(saturations) / len(used),
        observed_at=min(s.observed_at for s in values),
    )


def _limit(policy: Policy, wanted: int) -> Condition:
    if wanted > policy.max_replicas:
        return Condition(SCALING_LIMITED, True, "TooManyReplicas",
                         f"the load asks for {wanted} replicas; maxReplicas is {policy.max_replicas}")
    return Condition(SCALING_LIMITED, False, "DesiredWithinRange",
                     f"the load asks for {wanted} replicas, at most maxReplicas ({policy.max_replicas})")


def _clamp(policy: Policy, count: int) -> int:
    return max(policy.floor, min(policy.max_replicas, count))
