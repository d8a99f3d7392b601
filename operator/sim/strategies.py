"""How a fleet's replicas and scheduling policy are chosen, once per control interval.

Every strategy has one shape, `ControlLoop`, which does what the operator's control loop does
with one interval's reading (control.py: the autoscaler first, then the tuner, which judges
whether the engine can still scale from the replicas the interval began with). They differ
only in the spec they carry:
- `kvpilot`: autoscaling on, autoscaler.decide as the operator runs it: the capacity count and
  the per-replica terms (KV-cache usage and queue);
- `queue-only`: the same decide() with the KV term switched off (its target infinite) and the
  capacity count off: a KEDA-style trigger on
  vllm:num_requests_waiting, scaling up by at most max(100 %, 4 pods) per period and down over a
  300 s stabilization window. (The HPA itself computes ceil(total waiting / target), a backlog
  read as a rate; decide()'s queue term drains it over a horizon instead.)
- `kv-only`: the queue term switched off;
- `static-peak`, `static-mean`: autoscaling off, a fixed count;
- `oracle-reactive`, `ttft-planner`, `hpa-rps`: sized from the request rate (planners.py), under
  the autoscaler's stabilization windows and bounds;
each with `scheduling.policy: auto`, the CRD's default (the policy tuner on), and each also with
`+fcfs`: `fcfs` pinned, the tuner off. The
autoscaled ones also come with `+zero` (before any `+fcfs`): `minReplicas: 0`, scaling to zero
after `scaleToZeroAfterSeconds` idle; the CRD allows it only with routing, which holds the
requests that arrive at zero.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from kvpilot.operator import autoscaler, samples, tuner
from kvpilot.operator.sim import planners

BASES = ("static-peak", "static-mean", *planners.NAMES, "queue-only", "kv-only", "kvpilot")
AUTOSCALED = ("queue-only", "kv-only", "kvpilot")
PINNED = "+fcfs"
TO_ZERO = "+zero"
DEFAULTS = tuple(name + suffix for name in BASES for suffix in ("", PINNED))
NAMES = (*DEFAULTS, *(name + TO_ZERO + suffix for name in AUTOSCALED for suffix in ("", PINNED)))


@dataclass(frozen=True)
class Settings:
    """spec.autoscaling and spec.scheduling's fields, as the CRD defaults them."""

    min_replicas: int = 1
    max_replicas: int = 10
    target_kv_cache_usage: float = 0.8
    target_queue_depth: float = 5.0
    interval_seconds: float = 15.0
    scale_up_stabilization_seconds: float = 0.0
    scale_down_stabilization_seconds: float = 300.0
    scale_to_zero_after_seconds: float = 300.0  # with min_replicas 0
    backlog_drain_seconds: float = autoscaler.BACKLOG_DRAIN_SECONDS
    calm_window_seconds: float = 300.0


@dataclass
class ControlLoop:
    name: str
    spec: dict[str, Any]  # shaped as an InferenceEngine's spec, as the API server serves it
    # The tuner's view of the spec: the queue target as set, whichever term the autoscaler drops.
    tuner_spec: dict[str, Any]
    history: tuple[tuple[float, int], ...] = ()
    memory: autoscaler.Memory = field(default_factory=autoscaler.Memory)
    tuner_state: tuner.TunerState = field(default_factory=tuner.TunerState)
    # A planner's name and what it knows of the load (planners.py), for the rate-sized strategies.
    planner: tuple[str, planners.Rates] | None = None
    # Whether decide() sizes from capacity too (kvpilot) or from its per-replica terms alone.
    capacity_sizing: bool = True
    # The last decision's ready replicas to remove first (autoscaler.Decision.remove).
    remove: tuple[str, ...] = ()

    @property
    def replicas(self) -> int:
        return self.spec["replicas"]

    @property
    def autoscaled(self) -> bool:
        return bool(self.spec["autoscaling"]["enabled"])

    def decide(self, ready: list[str], starting: int, reading: samples.Reading, now: float,
               held: float | None = None) -> tuple[int, str]:
        """One interval: (spec.replicas, the effective scheduling policy). `held` is what the
        routers hold (None: no router), as control.py reads it."""
        spec = self.spec
        replicas = spec["replicas"]
        self.remove = ()
        if self.planner is not None:
            replicas = self._plan(ready, starting, now)
        elif self.autoscaled:
            scaling = dataclasses.replace(autoscaler.Policy.from_spec(spec["autoscaling"]),
                                          capacity_sizing=self.capacity_sizing)
            decision = autoscaler.decide(scaling, replicas, ready, starting, reading, self.history, now, self.memory,
                                         held=held)
            self.history = decision.history
            self.memory = decision.memory
            self.remove = decision.remove
            replicas = decision.replicas
        policy = spec["scheduling"]["policy"]
        if policy == tuner.AUTO:
            depths = tuner.queue_depths(reading, ready, now=now, interval_seconds=spec["autoscaling"]["intervalSeconds"])
            view = self.tuner_spec
            view["replicas"] = spec["replicas"]
            chosen = tuner.decide_policy(view, can_scale=tuner.can_scale_further(view), queue_depths=depths,
                                         previous=self.tuner_state, now=now, starting=starting)
            self.tuner_state = chosen.state
            policy = chosen.policy
        spec["replicas"] = replicas
        return replicas, policy

    def _plan(self, ready: list[str], starting: int, now: float) -> int:
        name, rates = self.planner
        replicas = self.spec["replicas"]
        policy = autoscaler.Policy.from_spec(self.spec["autoscaling"])
        since = now if self.memory.since is None else self.memory.since
        self.memory = autoscaler.Memory(since=since)
        wanted = planners.recommend(name, rates, now, policy.interval_seconds, replicas)
        # Starting pods are never removed, as the autoscaler never removes them.
        lowest = min(replicas, len(ready) + starting) if starting else 0
        target, self.history = autoscaler.stabilized(policy, replicas, wanted,
                                                     self.history, now, since, lowest=lowest)
        return target


def build(name: str, settings: Settings, *, initial: int, peak: int, mean: int,
          rates: planners.Rates | None = None) -> ControlLoop:
    """The strategy called `name` (one of NAMES); `peak` and `mean` are the static counts, and
    the autoscaled ones start from `initial` replicas; the planners need `rates`."""
    if name not in NAMES:
        raise ValueError(f"unknown strategy {name!r}: one of {', '.join(NAMES)}")
    if name.removesuffix(PINNED) in planners.NAMES and rates is None:
        raise ValueError(f"strategy {name!r} needs the trace's rates")
    base, pinned = name.removesuffix(PINNED), name.endswith(PINNED)
    base, to_zero = base.removesuffix(TO_ZERO), base.endswith(TO_ZERO)
    kv, queue = settings.target_kv_cache_usage, settings.target_queue_depth
    if base == "queue-only":
        kv = math.inf
    elif base == "kv-only":
        queue = math.inf
    static = {"static-peak": peak, "static-mean": mean}.get(base)
    spec = {
        "replicas": static if static is not None else min(settings.max_replicas, max(settings.min_replicas, initial)),
        "autoscaling": {
            "enabled": static is None,
            "minReplicas": 0 if to_zero else settings.min_replicas,
            "maxReplicas": settings.max_replicas,
            "targetKVCacheUsage": kv,
            "targetQueueDepth": queue,
            "intervalSeconds": settings.interval_seconds,
            "scaleUpStabilizationSeconds": settings.scale_up_stabilization_seconds,
            "scaleDownStabilizationSeconds": settings.scale_down_stabilization_seconds,
            "scaleToZeroAfterSeconds": settings.scale_to_zero_after_seconds,
            "backlogDrainSeconds": settings.backlog_drain_seconds,
        },
        "scheduling": {"policy": tuner.CALM_POLICY if pinned else tuner.AUTO,
                       "calmWindowSeconds": settings.calm_window_seconds},
    }
    tuner_spec = {**spec, "autoscaling": {**spec["autoscaling"], "targetQueueDepth": settings.target_queue_depth}}
    planner = (base, rates) if base in planners.NAMES else None
    return ControlLoop(name, spec, tuner_spec, planner=planner, capacity_sizing=base == "kvpilot")
