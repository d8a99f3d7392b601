"""The policy tuner's controller in the control loop: one engine's decision (tuner.py) applied,
each interval, from the same reading the autoscaler gets.

A decision that changes the effective policy is recorded in status.effectiveSchedulingPolicy (in
the control loop's one status write of the interval) and in an Event. Then, whatever was decided,
the policy is made true wherever it may have drifted:
the scheduling ConfigMap that starting pods read, and every ready pod, read back and switched
where it differs (a pod that restarted, or was not ready at the switch). So each interval repairs
what the last one could not reach. Engines with a pinned policy are not this controller's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import kopf

from kvpilot.operator import control_memory, engine_admin, kube, metrics, reconcile, render, tuner
from kvpilot.operator.controller import Interval, Key, Step


logger = logging.getLogger(__name__)

CHANGED = "SchedulingPolicyChanged"


class PolicyTuning:
    memory = control_memory.TUNER
    # Its fields and conditions stay as the record of its last decision once it is turned off.
    status_fields: tuple[str, ...] = ()
    condition_types: tuple[str, ...] = ()

    def __init__(
        self, reconciler: reconcile.Reconciler, *, pod_url: Callable[[Mapping[str, Any]], str | None] = metrics.pod_url
    ) -> None:
        self._reconciler = reconciler
        self._pod_url = pod_url
        # What each engine's last decision handed on; after a restart or a failover, status's.
        self._states: dict[Key, tuner.TunerState] = {}

    def wants(self, spec: Mapping[str, Any]) -> bool:
        return spec["scheduling"]["policy"] == tuner.AUTO

    def forget(self, key: Key) -> None:
        self._states.pop(key, None)

    async def step(self, interval: Interval) -> Step:
        engine = interval.engine
        meta, spec = engine["metadata"], engine["spec"]
        key = (meta["namespace"], meta["name"])
        seconds = spec["autoscaling"]["intervalSeconds"]
        depths = tuner.queue_depths(interval.reading, [metrics.pod_name(pod) for pod in interval.ready],
                                    now=interval.now, interval_seconds=seconds)
        decision = tuner.decide_policy(spec, can_scale=tuner.can_scale_further(spec), queue_depths=depths,
                                       previous=self._states.get(key) or _restored(engine, interval.now),
                                       now=interval.now, starting=interval.starting)
        self._states[key] = decision.state
        if not depths and interval.ready and not spec["autoscaling"]["enabled"]:
            # With autoscaling on, the autoscaler reports the reading's problems (MetricsAvailable).
            # With no ready pod there is nothing to read yet (scaled to zero, or starting): no news.
            logger.warning(f"InferenceEngine {key[0]}/{key[1]}: no usable queue reading ({_unusable(interval)});"
                           f" keeping {decision.policy}")
        recorded = render.effective_scheduling_policy(engine)

        def effective(_: Mapping[str, Any]) -> dict[str, Any]:
            memory = control_memory.encoded_tuner(decision.state, interval.now)
            return {"effectiveSchedulingPolicy": decision.policy, control_memory.FIELD: {control_memory.TUNER: memory}}

        async def made_true() -> None:
            if decision.policy != recorded:
                kopf.info(engine, reason=CHANGED, message=f"{recorded} -> {decision.policy}: {decision.message}")
            await self._keep_start_policy(engine, decision.policy)
            await self._bring_pods_in_line(engine, interval.ready, decision.policy, metrics.request_timeout(seconds))

        return Step(effective, made_true)

    async def _keep_start_policy(self, engine: Mapping[str, Any], policy: str) -> None:
        wanted = render.scheduling_config_map(engine, policy)
        if self._reconciler.as_applied(wanted):
            return  # its watch would have said if it changed since
        current = await self._reconciler.read_child(kube.path_of(wanted))
        # A missing one is the reconcile pass's to create, with its Created Event, from the policy
        # status records: an engine's first interval may come before its first pass.
        if current is not None and current.get("data") != wanted["data"]:
            await self._reconciler.apply_child(wanted)

    async def _bring_pods_in_line(
        self, engine: Mapping[str, Any], ready: Sequence[Mapping[str, Any]], policy: str, timeout: float
    ) -> None:
        targets = {metrics.pod_name(pod): url for pod in ready if (url := self._pod_url(pod)) is not None}
        if not targets:
            return
        name = f"{engine['metadata']['namespace']}/{engine['metadata']['name']}"
        token = await self._reconciler.admin_token_in_use(engine)
        if token is None:
            logger.warning(f"InferenceEngine {name}: its admin token Secret is missing or not a token;"
                           " reconciling to make one, the pods are switched next interval")
            # A fresh read: this interval may have just recorded a new effective policy.
            await self._reconciler.reconcile_current(engine["metadata"]["namespace"], engine["metadata"]["name"])
            return
        for result in await engine_admin.apply_policy(targets, policy, token, timeout=timeout):
            if result.outcome == engine_admin.FAILED:
                logger.warning(f"InferenceEngine {name}: pod {result.pod} is not switched to {policy}"
                               f" (tried again next interval): {result.detail}")
            elif result.outcome == engine_admin.SWITCHED:
                logger.info(f"InferenceEngine {name}: pod {result.pod} switched {result.detail}")


def _restored(engine: Mapping[str, Any], now: float) -> tuner.TunerState:
    """The state the last operator left in status (control_memory.py), where it agrees with the
    effective policy recorded there; else a fresh start from that policy."""
    restored = control_memory.restored_tuner(engine.get("status"), engine["spec"], now=now)
    if restored is not None and restored.policy == render.effective_scheduling_policy(engine):
        return restored
    return tuner.initial_state(engine)


def _unusable(interval: Interval) -> str:
    reading = interval.reading
    if reading.failure is not None:
        return reading.failure.message
    if reading.problems:
        return "; ".join(problem.message for problem in list(reading.problems.values())[:3])
    return "a sample is stale"
