"""The autoscaler: a window of per-pod samples -> desired replicas. Pure: no I/O, the clock is a
parameter, and what it remembers between intervals (its recent recommendations, the last
reading, a replica's capacity and how long a replica takes to start) goes in and comes out as a
value.

What the load needs, in replicas, is the larger of two counts:
- Capacity: the fleet's arrivals (what the replicas finished plus the growth of what they run
  and queue, averaged over the last two intervals) over what a replica completes per second
  (its capacity, measured while replicas were saturated: Memory.capacity), plus the backlog
  drained within backlogDrainSeconds, times the headroom learnt from backlogs that stood
  (Memory.headroom, 1 until one does). The backlog counted is the one the fleet will hold when a
  replica asked for now is ready: what waits beyond targetQueueDepth per replica and what the
  routers hold, plus what arrives meanwhile beyond what the replicas ready admit into their
  free KV cache and complete, and the starting ones complete (each from its expected ready
  time, learnt from the pods seen starting: Memory.startup). New replicas are asked only for
  what they can drain once ready, so a backlog that the replicas ready or on their way will
  absorb asks for none; there is no fixed x2-or-+4 step.
- Pressure: ready x the mean over ready replicas of the largest of KV / targetKVCacheUsage, the
  queue (waiting / targetQueueDepth, at most 1 where the capacity count sees the backlog; before a
  capacity is known the excess is read in batches of what the replica runs), and, with
  autoscaling.targets, each latency's p90 over the interval / its target (LATENCY_QUANTILE).
The count holds within 10 % of the replicas (TOLERANCE).

- Scaling up takes the lowest recommendation of the last scaleUpStabilizationSeconds (0: the
  current one).
- Scaling down takes the highest recommendation of the last scaleDownStabilizationSeconds, and
  waits for that window to have passed since the autoscaler's memory began (as the HPA does).
  It never removes a pod that is still starting: a ReplicaSet deletes unready pods first, so no
  count below the pods ready and starting is written while one starts. The ready pods to go are
  the least loaded (Decision.remove), which the operator marks with a lower
  controller.kubernetes.io/pod-deletion-cost before it writes the count.
- ScalingLimited is True while the load asks for more than maxReplicas.
- The result lies within [minReplicas, maxReplicas], even where spec.replicas does not (the CRD
  accepts any count, as the HPA's target does).
- Missing, stale or invalid metrics hold the count (within the bounds) and say why in
  MetricsAvailable. A latency histogram missing where a target asks for it leaves KV and queue in
  charge, and MetricsAvailable says so in its reason (LatencyMissing).

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
# autoscaling.backlogDrainSeconds's default: within a client's patience (the simulator's and
# many clients' request timeout is 60 s), and long enough that a flash crowd's backlog asks for
# replicas in proportion to it rather than to its first interval.
BACKLOG_DRAIN_SECONDS = 60.0
# How long a replica takes to be ready, until the autoscaler has seen one start (image pull and
# weight load of a GPU pod).
STARTUP_SECONDS = 120.0
# The weight of the latest start in Memory.startup: one slow node does not set it.
STARTUP_WEIGHT = 0.5
# The replica-seconds of saturation a replica's capacity is measured over (Memory.capacity): an
# hour of one replica's, or a few minutes of a fleet's; older ones weigh less.
CAPACITY_WINDOW_SECONDS = 3600.0
# Readings that say nothing of a replica's capacity although it is saturated. A KV cache this
# full preempts (the engine recomputes what it evicts), so the replica finishes less than it does
# at its target. A KV cache growing faster than KV_FILLING_PER_SECOND (a fifth of the cache a
# minute) belongs to a replica still filling up: the requests it finishes were taken in before,
# at a lighter load, and a long request admitted now finishes minutes later (0.17 requests/s a
# replica at a flash crowd's first backlog, where the replica sustains 0.48).
KV_FULL = 0.95
KV_FILLING_PER_SECOND = 0.2 / 60
# Memory.headroom: how far below their measured capacity the replicas are to run. A Service puts
# each request on a replica at random, and long requests swing a replica's KV cache: one fills,
# preempts and queues while the fleet's mean has room, and its queue drains only at what it
# completes less its share of the arrivals. A backlog that stands through the standing window
# (_standing_window) with no replica on its way says the fleet runs too close to its capacity for
# these requests: each such interval raises the headroom by HEADROOM_STEP per window, up to
# HEADROOM_MAX (a third of their capacity left unused); each interval without a backlog lowers it
# by HEADROOM_RELAX_PER_HOUR, down to 1.
HEADROOM_STEP = 0.2
HEADROOM_MAX = 1.5
HEADROOM_RELAX_PER_HOUR = 0.1
# The latencies' percentile read against autoscaling.targets: p90, not p99. A replica serves tens
# of requests per interval; their p99 is their maximum, one slow request, while their p90 moves
# with the queueing that more replicas cure.
LATENCY_QUANTILE = 0.9
# A replica's latency counts once this many requests (tokens, for ITL) were observed in the
# interval; fewer say nothing about a percentile.
LATENCY_MIN_OBSERVATIONS = 10
# A sample older than this many intervals is stale.
STALE_INTERVALS = 3
# Pods named in a condition message before the rest are counted.
_NAMED_PODS = 5

METRICS_AVAILABLE = "MetricsAvailable"
SCALING_LIMITED = "ScalingLimited"
SCALED_UP = "ScaledUp"
SCALED_DOWN = "ScaledDown"
# MetricsAvailable's reason (status True) when a latency target has no histogram to read.
LATENCY_MISSING = "LatencyMissing"
# The annotation by which a ReplicaSet picks, among ready pods, which to delete first (lowest).
POD_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"

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
    backlog_drain_seconds: float = BACKLOG_DRAIN_SECONDS
    target_ttft_seconds: float | None = None  # autoscaling.targets, at LATENCY_QUANTILE
    target_itl_seconds: float | None = None
    # The capacity count on (the CRD has no switch: the simulator's queue-only baseline, a KEDA
    # trigger on the queue alone, turns it off).
    capacity_sizing: bool = True

    @classmethod
    def from_spec(cls, autoscaling: Mapping[str, Any]) -> Policy:
        """From spec.autoscaling as the API server serves it (the CRD's defaults applied)."""
        targets = autoscaling.get("targets") or {}
        return cls(
            min_replicas=autoscaling["minReplicas"],
            max_replicas=autoscaling["maxReplicas"],
            target_kv_cache_usage=autoscaling["targetKVCacheUsage"],
            target_queue_depth=autoscaling["targetQueueDepth"],
            interval_seconds=autoscaling["intervalSeconds"],
            scale_up_stabilization_seconds=autoscaling["scaleUpStabilizationSeconds"],
            scale_down_stabilization_seconds=autoscaling["scaleDownStabilizationSeconds"],
            scale_to_zero_after_seconds=autoscaling["scaleToZeroAfterSeconds"],
            backlog_drain_seconds=autoscaling["backlogDrainSeconds"],
            target_ttft_seconds=targets.get("ttftSeconds"),
            target_itl_seconds=targets.get("itlSeconds"),
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
    # The fleet's arrivals per second and its backlog when a replica asked for now is ready
    # (None: unknown, no capacity or no rates yet), and the replicas these ask for.
    arrival_rate: float | None = None
    backlog: float | None = None
    capacity_replicas: float | None = None
    headroom: float = 1.0


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
    # On a scale-down, the ready pods to go first, the least loaded first.
    remove: tuple[str, ...] = ()


@dataclass(frozen=True)
class Memory:
    """What one reading leaves for the next: the pods' samples, for their rates since; the
    requests replicas finished while they were saturated and the replica-seconds that took (see
    `capacity`); when the memory began (None: it begins with this reading); since when the
    engine has been idle, without a break (None: it is not); when each replica now on its way
    was first seen on its way, oldest first; how long a replica takes to be ready (None: none
    was seen to start); the fleet's arrivals per second over the last interval (None:
    unknown); since when the fleet has held a backlog without a break and with no replica on its
    way (None: it has not); and the headroom learnt from such backlogs (HEADROOM_STEP)."""

    pods: Mapping[str, samples.PodSample] = field(default_factory=dict)
    saturated_finished: float = 0.0
    saturated_seconds: float = 0.0
    since: float | None = None
    idle_since: float | None = None
    on_way_since: tuple[float, ...] = ()
    startup_seconds: float | None = None
    arrival_rate: float | None = None
    backlog_since: float | None = None
    headroom: float = 1.0

    @property
    def capacity(self) -> float | None:
        """What a replica completes per second while saturated (_saturated_work says which
        readings count); None until one was seen to finish anything. One interval's count is
        noise for long requests (a replica finishes a few, or none, in 15 s), so it is the ratio
        of the totals over CAPACITY_WINDOW_SECONDS of saturation."""
        return self.saturated_finished / self.saturated_seconds if self.saturated_finished > 0 else None

    @property
    def startup(self) -> float:
        return STARTUP_SECONDS if self.startup_seconds is None else self.startup_seconds


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
        # What a replica can do and how long it takes to start outlast the replicas.
        at_zero = dataclasses.replace(memory, pods={}, since=since, idle_since=None, on_way_since=())
        return _at_zero(policy, held, history, at_zero, now)
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
    idle = policy.min_replicas == 0 and _idle(used, starting, held)
    idle_since = (now if memory.idle_since is None else memory.idle_since) if idle else None
    on_way = max(starting, replicas - len(ready))
    on_way_since, startup_seconds = _starts(memory, len(ready), on_way, now)
    before, last_arrival_rate = memory.pods, memory.arrival_rate
    rates = _fleet_rates(used, before)
    waiting = _backlog(policy, used, held if isinstance(held, float | int) else 0.0)
    backlog_since = None if waiting <= 0 or on_way else (now if memory.backlog_since is None else memory.backlog_since)
    memory = Memory(used, *_saturated_work(policy, used, memory), since=since, idle_since=idle_since,
                    on_way_since=on_way_since, startup_seconds=startup_seconds,
                    arrival_rate=None if rates is None else rates[1], backlog_since=backlog_since,
                    headroom=_headroom(policy, memory.headroom, backlog_since, waiting, startup_seconds, now))
    load = _load(policy, used, before, memory, rates, last_arrival_rate, waiting, now)
    needed = max(len(ready) * load.saturation, load.capacity_replicas or 0.0)

    wanted = replicas if abs(needed - replicas) <= TOLERANCE * replicas else math.ceil(needed - 1e-9)
    recommendation = _clamp(policy, wanted)

    # A ReplicaSet removes unready pods first: while one starts, only pods not yet created may go.
    lowest = min(replicas, len(ready) + starting) if starting else 0
    target, history = stabilized(policy, replicas, recommendation, history, now, since, lowest=lowest)

    summary = _summary(policy, load, len(ready), starting)
    conditions = (_available(policy, used), _limit(policy, wanted))
    if idle_since is not None and now - idle_since >= policy.scale_to_zero_after_seconds:
        target = 0
        summary = (f"idle for {now - idle_since:.0f}s (scaleToZeroAfterSeconds"
                   f" {policy.scale_to_zero_after_seconds:g}): no request running, waiting or held")
    if target > replicas:  # on their way from now
        memory = dataclasses.replace(memory, on_way_since=(*memory.on_way_since, *(now,) * (target - replicas)))
    if target == replicas:
        return Decision(replicas, "", summary, conditions, load, history, memory)
    reason = SCALED_UP if target > replicas else SCALED_DOWN
    remove = _least_loaded(used, len(ready) + starting - target) if reason == SCALED_DOWN else ()
    return Decision(target, reason, f"{replicas} -> {target} replicas: {summary}", conditions, load, history, memory,
                    remove)


def stabilized(policy: Policy, replicas: int, recommendation: int, history: tuple[tuple[float, int], ...],
               now: float, since: float, *, lowest: int = 0) -> tuple[int, tuple[tuple[float, int], ...]]:
    """(the count to write, the next call's history) for a recommendation, under the
    stabilization windows and the bounds; a scale-down goes no lower than `lowest`. The
    simulator's planners share it, so that every strategy scales under the same rules."""
    recommendation = _clamp(policy, recommendation)
    window = max(policy.scale_up_stabilization_seconds, policy.scale_down_stabilization_seconds)
    history = (*((t, r) for t, r in history if t >= now - window), (now, recommendation))
    up = min(r for t, r in history if t >= now - policy.scale_up_stabilization_seconds)
    down = max(r for t, r in history if t >= now - policy.scale_down_stabilization_seconds)
    if up > replicas:
        target = up
    elif down < replicas and now - since >= policy.scale_down_stabilization_seconds:
        # Only once the recommendations on record cover the whole window: those from before the
        # memory began (a restarted operator, autoscaling just turned on) are unknown, and the
        # count that runs may rest on them.
        target = max(down, lowest)
    else:
        target = replicas
    return _clamp(policy, target), history


def _at_zero(policy: Policy, held: float | samples.Problem | None, history: tuple[tuple[float, int], ...],
             memory: Memory, now: float) -> Decision:
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
                    conditions, None, history, dataclasses.replace(memory, on_way_since=(now,) * policy.floor))


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


def _saturated_work(policy: Policy, used: Mapping[str, samples.PodSample], memory: Memory) -> tuple[float, float]:
    """Memory's (finished, replica-seconds) while saturated, with what each saturated pod did
    since its last reading; beyond the window both shrink in proportion, which forgets the oldest.
    A pod is saturated when it queues beyond targetQueueDepth or its KV cache is at
    targetKVCacheUsage or above, unless its KV cache is full or filling up (KV_FULL,
    KV_FILLING_PER_SECOND)."""
    finished, seconds = memory.saturated_finished, memory.saturated_seconds
    for pod, sample in used.items():
        before = memory.pods.get(pod)
        progress = _progress(sample, before)
        if progress is None:
            continue
        elapsed, done = progress
        kv = sample.kv_cache_usage
        saturated = sample.num_waiting > policy.target_queue_depth or kv >= policy.target_kv_cache_usage
        filling = kv - before.kv_cache_usage > KV_FILLING_PER_SECOND * elapsed
        if saturated and kv < KV_FULL and not filling:
            finished, seconds = finished + done, seconds + elapsed
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
    counter, and that plus the growth of what it runs and queues (a replica with room admits what
    arrives, and a long request stays minutes). None when unknown (see _progress)."""
    progress = _progress(sample, before)
    if progress is None:
        return None
    elapsed, done = progress
    grown = sample.num_running + sample.num_waiting - before.num_running - before.num_waiting
    return done / elapsed, max(0.0, (done + grown) / elapsed)


def _starts(memory: Memory, ready: int, on_way: int, now: float) -> tuple[tuple[float, ...], float | None]:
    """Memory's on_way_since and startup_seconds after this reading: replicas that left the way
    while the ready count grew became ready (oldest first), and their time on the way is a start."""
    since, startup = memory.on_way_since, memory.startup_seconds
    left = max(0, len(since) - on_way)
    became_ready = min(left, max(0, ready - len(memory.pods)))
    for began in since[:became_ready]:
        seen = now - began
        startup = seen if startup is None else STARTUP_WEIGHT * seen + (1 - STARTUP_WEIGHT) * startup
    kept = since[left:]
    return (*kept, *(now,) * (on_way - len(kept))), startup


def _fleet_rates(used: Mapping[str, samples.PodSample],
                 before: Mapping[str, samples.PodSample]) -> tuple[float, float] | None:
    """(completed, arrived) requests per second at the ready replicas since the last reading;
    None where no pod has rates (a pod without them is new, or exports no counter)."""
    rates = [rate for pod, sample in used.items() if (rate := _rates(sample, before.get(pod))) is not None]
    if not rates:
        return None
    return sum(completed for completed, _ in rates), sum(arrived for _, arrived in rates)


def _backlog(policy: Policy, used: Mapping[str, samples.PodSample], held: float) -> float:
    """The requests waiting beyond targetQueueDepth at each ready replica, and those the routers hold."""
    return sum(max(0.0, s.num_waiting - policy.target_queue_depth) for s in used.values()) + held


def _standing_window(policy: Policy, startup: float) -> float:
    """How long a backlog stands before it raises the headroom: no shorter than the wait before a
    scale-down (the load's fall is not believed sooner, nor is a backlog's standing), nor than a
    replica asked for at the backlog's start takes to be ready and drain it."""
    return max(policy.scale_down_stabilization_seconds, startup + policy.backlog_drain_seconds)


def _headroom(policy: Policy, headroom: float, backlog_since: float | None, backlog: float,
              startup_seconds: float | None, now: float) -> float:
    """Memory.headroom after this reading (see HEADROOM_STEP)."""
    window = _standing_window(policy, STARTUP_SECONDS if startup_seconds is None else startup_seconds)
    if backlog_since is not None and now - backlog_since >= window:
        return min(HEADROOM_MAX, headroom + HEADROOM_STEP * policy.interval_seconds / window)
    if backlog <= 0:
        return max(1.0, headroom - HEADROOM_RELAX_PER_HOUR * policy.interval_seconds / 3600)
    return headroom


def _capacity_replicas(policy: Policy, memory: Memory, ready: int, rates: tuple[float, float], backlog: float,
                       room: float, capacity: float, now: float) -> tuple[float, float]:
    """(replicas, backlog then): the replicas that take the arrivals and drain, within
    backlogDrainSeconds (D), the backlog the fleet will hold when a replica asked for now is
    ready, S seconds from now. Only requests that will have waited less than D by then count:
    older ones are served late whatever is added (or given up by their clients), so a replica
    that cannot be ready in time for them is not asked for them. Over the last D seconds before
    S, the replicas ready admit `room` requests (_room) and complete what they complete now or
    `capacity` each, whichever is more (replicas that keep up show a capacity the estimate may
    not have seen yet), and those on their way `capacity` each from their expected ready time.
    The replicas run `memory.headroom` below their capacity."""
    completed, arrival = rates
    startup, drain = memory.startup, policy.backlog_drain_seconds
    window = min(drain, startup)
    opens = startup - window
    # Each replica on its way is ready `startup` after it was asked for: its time ready in the window.
    arriving = sum(max(0.0, startup - max(opens, startup - (now - began))) for began in memory.on_way_since)
    taken = room + max(completed, capacity * ready) * window + capacity * arriving
    later = max(0.0, (backlog if opens == 0 else 0.0) + arrival * window - taken)
    return (arrival + later / drain) / capacity * memory.headroom, later


def _latency_term(policy: Policy, sample: samples.PodSample, before: samples.PodSample | None) -> float:
    """The pod's latencies over the interval in their targets (0 without targets, or too few
    observations to say)."""
    term = 0.0
    for target, now_buckets, then_buckets in ((policy.target_ttft_seconds, sample.ttft, before and before.ttft),
                                              (policy.target_itl_seconds, sample.itl, before and before.itl)):
        if target is None or now_buckets is None or then_buckets is None:
            continue
        latency = quantile(LATENCY_QUANTILE, now_buckets, then_buckets)
        if latency is not None:
            term = max(term, latency / target)
    return term


def quantile(q: float, buckets: samples.Buckets, earlier: samples.Buckets) -> float | None:
    """The q-quantile of what was observed between two readings of a histogram's cumulative
    buckets, interpolated within its bucket as PromQL's histogram_quantile does; None with fewer
    than LATENCY_MIN_OBSERVATIONS, or buckets that changed or went back (a restarted engine)."""
    if [bound for bound, _ in buckets] != [bound for bound, _ in earlier]:
        return None
    counts = [count - then for (_, count), (_, then) in zip(buckets, earlier)]
    total = counts[-1]
    if total < LATENCY_MIN_OBSERVATIONS or any(count < 0 for count in counts):
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for (bound, _), count in zip(buckets, counts):
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # beyond the largest finite bound: that bound, as PromQL says
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / max(count - lower_count, 1e-12)
        lower_bound, lower_count = bound, count
    return lower_bound


def _queue_term(policy: Policy, sample: samples.PodSample, backlog_counted: bool) -> float:
    """Waiting over targetQueueDepth, up to the target; beyond it, where the capacity count does
    not see the backlog yet, the excess in batches of what the replica runs (at least the target)."""
    target = policy.target_queue_depth
    excess = sample.num_waiting - target
    if excess <= 0:
        return sample.num_waiting / target
    return 1.0 if backlog_counted else 1 + excess / max(sample.num_running, target)


def _room(policy: Policy, used: Mapping[str, samples.PodSample]) -> float:
    """The requests the ready replicas can still admit: the engine admits while its KV cache has
    free blocks, so a replica without a backlog takes what fits in its free KV at the footprint
    of the requests it runs now (nothing counted for one that runs none: no footprint to go by)."""
    return sum(s.num_running * (1 - s.kv_cache_usage) / s.kv_cache_usage for s in used.values()
               if s.num_waiting <= policy.target_queue_depth and 0 < s.kv_cache_usage < 1)


def _load(policy: Policy, used: Mapping[str, samples.PodSample], before: Mapping[str, samples.PodSample],
          memory: Memory, rates: tuple[float, float] | None, last_arrival_rate: float | None, waiting: float,
          now: float) -> Load:
    """The reading's load; `rates` are the fleet's (completed, arrived) per second over this
    interval, `last_arrival_rate` its arrivals over the one before (None: unknown), `waiting` its
    backlog now (_backlog)."""
    capacity = memory.capacity
    counted = policy.capacity_sizing and rates is not None and capacity is not None
    saturations = [max(s.kv_cache_usage / policy.target_kv_cache_usage, _queue_term(policy, s, counted),
                       _latency_term(policy, s, before.get(pod)))
                   for pod, s in used.items()]
    values = used.values()
    arrival = replicas = backlog = None
    if counted:
        # Two intervals' mean: one 15 s count of Poisson arrivals at 10/s is off by 8 % (one
        # standard deviation), and the count would follow it up and down.
        arrival = rates[1] if last_arrival_rate is None else (rates[1] + last_arrival_rate) / 2
        replicas, backlog = _capacity_replicas(policy, memory, len(used), (rates[0], arrival), waiting,
                                               _room(policy, used), capacity, now)
    return Load(
        kv_cache_usage=sum(s.kv_cache_usage for s in values) / len(used),
        queue_depth=sum(s.num_waiting for s in values) / len(used),
        saturation=sum(saturations) / len(used),
        observed_at=min(s.observed_at for s in values),
        arrival_rate=arrival,
        backlog=backlog,
        capacity_replicas=replicas,
        headroom=memory.headroom,
    )


def _least_loaded(used: Mapping[str, samples.PodSample], count: int) -> tuple[str, ...]:
    """The `count` ready pods with the fewest requests (running and waiting), then the least KV."""
    order = sorted(used.values(), key=lambda s: (s.num_running + s.num_waiting, s.kv_cache_usage, s.pod))
    return tuple(sample.pod for sample in order[:max(0, count)])


def _summary(policy: Policy, load: Load, ready: int, starting: int) -> str:
    text = (f"KV-cache usage {load.kv_cache_usage:.2f} (target {policy.target_kv_cache_usage:g}),"
            f" {load.queue_depth:.1f} waiting per replica (target {policy.target_queue_depth:g}),"
            f" saturation {load.saturation:.2f} over {ready} ready and {starting} starting replicas")
    if load.capacity_replicas is not None:
        text += (f"; {load.arrival_rate:.3g} requests/s arriving and a backlog of {load.backlog:.0f} when a new"
                 f" replica is ready ask for {load.capacity_replicas:.1f} replicas")
        if load.headroom > 1:
            text += f" ({load.headroom:.2f}x headroom: backlogs stood)"
    return text


def _available(policy: Policy, used: Mapping[str, samples.PodSample]) -> Condition:
    """MetricsAvailable=True; its reason says when a latency target has no histogram to read."""
    missing = [f"pod {pod} reports no {name}" for pod, sample in used.items()
               for name, target, buckets in ((samples.TTFT, policy.target_ttft_seconds, sample.ttft),
                                             (samples.ITL, policy.target_itl_seconds, sample.itl))
               if target is not None and buckets is None]
    if missing:
        more = f"; and {len(missing) - _NAMED_PODS} more" if len(missing) > _NAMED_PODS else ""
        return Condition(METRICS_AVAILABLE, True, LATENCY_MISSING,
                         "; ".join(missing[:_NAMED_PODS]) + more + ": KV-cache usage and queue depth decide alone")
    return Condition(METRICS_AVAILABLE, True, "MetricsRead", f"read {len(used)} ready replicas")


def _limit(policy: Policy, wanted: int) -> Condition:
    if wanted > policy.max_replicas:
        return Condition(SCALING_LIMITED, True, "TooManyReplicas",
                         f"the load asks for {wanted} replicas; maxReplicas is {policy.max_replicas}")
    return Condition(SCALING_LIMITED, False, "DesiredWithinRange",
                     f"the load asks for {wanted} replicas, at most maxReplicas ({policy.max_replicas})")


def _clamp(policy: Policy, count: int) -> int:
    return max(policy.floor, min(policy.max_replicas, count))
