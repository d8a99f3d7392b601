"""The policy tuner of `scheduling.policy: auto` (the CRD's default): queue readings -> the
engines' live scheduling policy. Pure: no I/O, and the clock is a parameter.

An engine runs `fcfs` while it copes. When its queue per replica stays above
`autoscaling.targetQueueDepth` for PRESSURE_INTERVALS consecutive intervals and no replica can
relieve it now (autoscaling is off, it is at `maxReplicas`, or a replica is still starting), the
tuner switches it to `priority`, so that the tenants that matter most wait least while capacity is
short. A replica starting counts as short capacity: it is minutes from serving (image pull, weight
load), and a queue that a Service leaves on the replica it reached waits for it under `fcfs`. Once the queue has stayed
at or below target for `scheduling.calmWindowSeconds`, it goes back to `fcfs`. A pinned policy
(`fcfs` or `priority`) is never changed.

The loop calls `decide_policy` once per interval with that interval's readings and the state the
previous call returned.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.operator import autoscaler, render, samples

AUTO = "auto"
CALM_POLICY = "fcfs"
PRESSURE_POLICY = "priority"
# Consecutive intervals of pressure before switching: one busy interval may be a burst that the
# queue drains by itself.
PRESSURE_INTERVALS = 2


@dataclass(frozen=True)
class TunerState:
    """What one decision hands to the next."""

    policy: str = CALM_POLICY
    # Consecutive intervals, up to now, with the queue above target and no room to scale.
    pressured_intervals: int = 0
    # When the current stretch at or below target began, while under the pressure policy.
    calm_since: float | None = None


@dataclass(frozen=True)
class PolicyDecision:
    policy: str  # the effective policy
    reason: str  # CamelCase, for Events and logs
    message: str  # the reason with its numbers
    state: TunerState


def initial_state(engine: Mapping[str, Any]) -> TunerState:
    """Where to start when the operator (re)starts: the effective policy it recorded in status."""
    return TunerState(render.effective_scheduling_policy(engine))


def can_scale_further(spec: Mapping[str, Any]) -> bool:
    """Whether the autoscaler could still add a replica."""
    autoscaling = spec["autoscaling"]
    return bool(autoscaling["enabled"]) and spec["replicas"] < autoscaling["maxReplicas"]


def queue_per_replica(queue_depths: Sequence[float]) -> float | None:
    """The mean of the ready replicas' waiting-request counts; None when there is no reading or a
    reading is not a count (NaN, infinite, negative), since no decision may rest on it."""
    if not queue_depths or any(not math.isfinite(d) or d < 0 for d in queue_depths):
        return None
    return sum(queue_depths) / len(queue_depths)


def queue_depths(reading: samples.Reading, ready: Sequence[str], *, now: float, interval_seconds: float
                 ) -> list[float]:
    """Each ready pod's waiting requests in one interval's reading; none at all where the reading
    failed or a ready pod lacks a fresh, valid sample, as then the autoscaler holds too."""
    if reading.failure is not None:
        return []
    depths = []
    for pod in ready:
        sample = reading.samples.get(pod)
        if sample is None or now - sample.observed_at > autoscaler.STALE_INTERVALS * interval_seconds:
            return []
        depths.append(sample.num_waiting)
    return depths


def decide_policy(
    spec: Mapping[str, Any],
    *,
    can_scale: bool,
    queue_depths: Sequence[float],
    previous: TunerState,
    now: float,
    starting: int = 0,
) -> PolicyDecision:
    """One interval's decision. `queue_depths` holds each ready replica's waiting requests for this
    interval; `starting` counts the pods not ready yet; `now` is in seconds on any clock that the
    previous decisions used too."""
    policy = spec["scheduling"]["policy"]
    if policy != AUTO:
        return PolicyDecision(policy, "Pinned", f"spec.scheduling.policy pins {policy}", TunerState(policy))
    target = spec["autoscaling"]["targetQueueDepth"]
    depth = queue_per_replica(queue_depths)
    if depth is None:
        # Neither pressure nor calm can be claimed without a reading: both stretches start over.
        return PolicyDecision(previous.policy, "MetricsMissing",
                              f"no usable queue reading: keeping {previous.policy}", TunerState(previous.policy))
    reading = f"{depth:.3g} waiting requests per replica (target {target:g})"

    if previous.policy != PRESSURE_POLICY:
        short = "the engine cannot scale further" if not can_scale else (
            f"{starting} replica{'s' if starting > 1 else ''} still starting" if starting else None)
        pressured = previous.pressured_intervals + 1 if depth > target and short else 0
        if pressured >= PRESSURE_INTERVALS:
            return PolicyDecision(PRESSURE_POLICY, "QueueAboveTarget",
                                  f"{reading} for {pressured} intervals, and {short}", TunerState(PRESSURE_POLICY))
        if pressured:
            reason, why = "PressureBuilding", f"{reading}, interval {pressured} of {PRESSURE_INTERVALS}"
        elif depth > target:
            reason, why = "ScalingOut", f"{reading}; the autoscaler can still add replicas"
        else:
            reason, why = "Calm", reading
        return PolicyDecision(CALM_POLICY, reason, why, TunerState(CALM_POLICY, pressured_intervals=pressured))

    if depth > target:
        return PolicyDecision(PRESSURE_POLICY, "QueueAboveTarget", reading, TunerState(PRESSURE_POLICY))
    window = spec["scheduling"]["calmWindowSeconds"]
    calm_since = now if previous.calm_since is None else previous.calm_since
    calm_for = now - calm_since
    if calm_for >= window:
        return PolicyDecision(CALM_POLICY, "CalmWindowPassed",
                              f"{reading} for {calm_for:.0f}s (calmWindowSeconds {window})", TunerState(CALM_POLICY))
    return PolicyDecision(PRESSURE_POLICY, "Calming", f"{reading} for {calm_for:.0f}s of {window}s",
                          TunerState(PRESSURE_POLICY, calm_since=calm_since))
