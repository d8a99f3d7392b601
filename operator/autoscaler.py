"""The autoscaler: a window of per-pod samples -> desired replicas. Pure: no I/O, the clock is a
parameter, and what it remembers between intervals (its recent recommendations) goes in and
comes out as a value.

- Per ready replica, saturation = max(kv / targetKVCacheUsage, queue term). The queue term is
  waiting / targetQueueDepth up to the target (1). Beyond it the excess waiting is a backlog, a
  stock of requests and not a rate, so it is read in replicas' batches: 1 + excess / batch, where
  batch is what the replica runs now (num_requests_running, at least targetQueueDepth). That many
  added replicas take the backlog into their batches at once: it drains within about one batch
  turnover (a request's service time) by the capacity of the replicas added, where reading it as a
  rate would ask for one replica per targetQueueDepth waiting requests.
- The recommendation is ceil(ready x mean saturation), unless the mean lies within 10 % of 1.
- Scaling up takes the lowest recommendation of the last scaleUpStabilizationSeconds (0: the
  current one), and at most doubles the count (or adds 4, whichever is more) per decision;
  replicas still starting count as capacity already on its way.
- ScalingLimited is True while the load asks for more than maxReplicas.
- Scaling down takes the highest recommendation of the last scaleDownStabilizationSeconds.
- The result lies within [minReplicas, maxReplicas].
- Missing, stale or invalid metrics hold the count and say why in MetricsAvailable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.operator import samples

TOLERANCE = 0.1
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
        )


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


def decide(
    policy: Policy,
    replicas: int,
    ready: Sequence[str],
    starting: int,
    reading: samples.Reading,
    history: tuple[tuple[float, int], ...],
    now: float,
) -> Decision:
    """`replicas` is spec.replicas; `ready` names the ready pods, `starting` counts the pods that
    exist but are not ready yet (terminating ones count in neither)."""
    problem = _problem(policy, ready, starting, reading, now)
    if problem is not None:
        return Decision(replicas, "", problem.message, (problem,), None, history)
    used = [reading.samples[pod] for pod in ready]
    load = _load(policy, used)

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
    elif down < replicas:
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
    if target == replicas:
        return Decision(replicas, "", summary, conditions, load, history)
    reason = SCALED_UP if target > replicas else SCALED_DOWN
    return Decision(target, reason, f"{replicas} -> {target} replicas: {summary}", conditions, load, history)


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


def _queue_term(policy: Policy, sample: samples.PodSample) -> float:
    target = policy.target_queue_depth
    excess = sample.num_waiting - target
    if excess <= 0:
        return sample.num_waiting / target
    return 1 + excess / max(sample.num_running, target)


def _load(policy: Policy, used: Sequence[samples.PodSample]) -> Load:
    saturations = [max(s.kv_cache_usage / policy.target_kv_cache_usage, _queue_term(policy, s)) for s in used]
    return Load(
        kv_cache_usage=sum(s.kv_cache_usage for s in used) / len(used),
        queue_depth=sum(s.num_waiting for s in used) / len(used),
        saturation=sum(saturations) / len(used),
        observed_at=min(s.observed_at for s in used),
    )


def _limit(policy: Policy, wanted: int) -> Condition:
    if wanted > policy.max_replicas:
        return Condition(SCALING_LIMITED, True, "TooManyReplicas",
                         f"the load asks for {wanted} replicas; maxReplicas is {policy.max_replicas}")
    return Condition(SCALING_LIMITED, False, "DesiredWithinRange",
                     f"the load asks for {wanted} replicas, at most maxReplicas ({policy.max_replicas})")


def _clamp(policy: Policy, count: int) -> int:
    return max(policy.min_replicas, min(policy.max_replicas, count))
