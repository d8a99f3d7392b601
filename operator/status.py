"""The child workload (and the last reconcile's outcome) -> InferenceEngine status. Pure:
the clock is a parameter.

The workload is the engine's Deployment, or for an engine over several pods its LeaderWorkerSet,
whose replicas are groups: a group counts as ready when LeaderWorkerSet counts it so (its leader
ready, and its workers' StatefulSet), and status.replicas and readyReplicas count groups.

Status never claims Ready before the workload has rolled out the pod template of the current
spec: the workload carries the engine generation it was rendered from, and Ready needs that
generation, its controller's observation of it, and every updated replica available.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpilot.operator import autoscaler, naming, render, render_lws, render_router

READY = "Ready"
PROGRESSING = "Progressing"
# With routing: whether a router serves (takes requests, and holds them while no engine runs).
ROUTER_READY = "RouterReady"
SCALED_TO_ZERO = "ScaledToZero"
# True while the spec applies but part of it cannot work (a tenant's key Secret is missing):
# the engine serves, without what is broken, and the reconcile retries with a growing delay.
DEGRADED = "Degraded"
RECONCILE_FAILED = "ReconcileFailed"
TENANT_KEY_MISSING = "TenantKeyMissing"
LEADER_WORKER_SET_MISSING = "LeaderWorkerSetMissing"
AUTOSCALER_CONDITIONS = (autoscaler.METRICS_AVAILABLE, autoscaler.SCALING_LIMITED)
# The Deployment controller's reason when the API server refuses a pod, reused as is.
FAILED_CREATE = "FailedCreate"


@dataclass(frozen=True)
class _Verdict:
    phase: str  # Pending, Progressing, Ready, Degraded or Failed
    reason: str
    message: str
    # Every replica runs the current pod template (all of them may not be available).
    rolled_out: bool = False


def derive(
    engine: Mapping[str, Any],
    workload: Mapping[str, Any] | None,
    *,
    now: datetime.datetime,
    routers: Mapping[str, Any] | None = None,
    failure: str | None = None,
    problems: list[str] | None = None,
    unserved: str | None = None,
) -> dict[str, Any]:
    """The status fields the reconciler owns. `workload` is the engine's Deployment or
    LeaderWorkerSet (render_lws.workload says which), `routers` the routers' Deployment (with
    routing). `failure` is why applying the current spec failed;
    a failure recorded earlier for the same generation stands until the spec changes. `problems`
    are what a reconcile pass found missing (the Degraded condition); None leaves that condition
    as it is (a refresh that did not look). `unserved` says that the spec needs LeaderWorkerSet
    and the cluster does not serve it, so nothing of the spec was applied."""
    meta = engine["metadata"]
    spec = engine["spec"]
    current = engine.get("status") or {}
    failure = failure or standing_failure(engine)
    rollout = (workload or {}).get("status") or {}
    _, kind, _ = render_lws.workload(engine)

    if failure is not None:
        observed: int | None = meta["generation"]
        verdict = _Verdict("Failed", RECONCILE_FAILED, failure)
    elif unserved is not None:
        observed = current.get("observedGeneration")
        verdict = _Verdict("Pending", LEADER_WORKER_SET_MISSING, unserved)
    elif workload is None:
        observed = current.get("observedGeneration")
        verdict = _Verdict("Pending", f"{kind}Missing", f"the engine's {kind} does not exist yet")
    elif kind == render_lws.KIND:
        observed = rendered_generation(workload)
        verdict = _judge_groups(workload, meta["generation"], rolled_out_before=_rolled_out(current, observed))
    else:
        observed = rendered_generation(workload)
        verdict = _judge_rollout(workload, meta["generation"])

    stamp = timestamp(now)
    conditions = list(current.get("conditions", []))
    if render_router.routed(engine):
        router_ready, router_reason, router_message = _judge_routers(routers)
        conditions = set_condition(conditions, ROUTER_READY, router_ready, router_reason, router_message,
                                   observed, stamp)
        if router_ready and verdict.reason == SCALED_TO_ZERO:
            # Nothing runs, and nothing needs to: the routers take requests, and the first one
            # scales the engine up.
            verdict = _Verdict("Ready", SCALED_TO_ZERO, "no engine replica runs; the routers hold requests and"
                               " the first one scales the engine up", rolled_out=True)
    else:
        conditions = [c for c in conditions if c.get("type") != ROUTER_READY]
    autoscaled = spec["autoscaling"]["enabled"]
    if not autoscaled:
        # Once the autoscaler is off, its conditions would stand still, stale.
        conditions = [c for c in conditions if c.get("type") not in AUTOSCALER_CONDITIONS]
    conditions = set_condition(
        conditions, READY, verdict.phase == "Ready", verdict.reason, verdict.message, observed, stamp
    )
    if verdict.rolled_out:
        conditions = set_condition(
            conditions, PROGRESSING, False, "RolloutComplete",
            "every replica runs the current pod template", observed, stamp,
        )
    else:
        conditions = set_condition(
            conditions, PROGRESSING, verdict.phase == "Progressing", verdict.reason, verdict.message,
            observed, stamp,
        )

    if unserved is not None:
        conditions = set_condition(conditions, DEGRADED, True, LEADER_WORKER_SET_MISSING, unserved, observed, stamp)
    elif problems is not None:
        conditions = set_condition(
            conditions, DEGRADED, bool(problems), TENANT_KEY_MISSING if problems else "TenantKeysFound",
            "; ".join(problems) if problems else "every tenant's API key Secret is found", observed, stamp,
        )

    status: dict[str, Any] = {
        "phase": verdict.phase,
        "desiredReplicas": spec["replicas"],
        "replicas": rollout.get("replicas", 0),
        "readyReplicas": rollout.get("readyReplicas", 0),
        "selector": naming.selector_string(meta["name"]),
        "endpoint": render.endpoint(engine),
        "effectiveSchedulingPolicy": render.effective_scheduling_policy(engine),
        "conditions": conditions,
    }
    if observed is not None:
        status["observedGeneration"] = observed
    if not autoscaled and "metrics" in current:
        status["metrics"] = None  # the autoscaler's last reading, which nothing refreshes now
    return status


def autoscaling(
    engine: Mapping[str, Any], decision: autoscaler.Decision, *, now: datetime.datetime, scaled: bool
) -> dict[str, Any]:
    """The status fields the autoscaler owns, after `decision` (spec.replicas is written through
    the scale subresource, not here). The last good reading stays, with its time, while the
    metrics are unavailable. Nothing, once autoscaling is off (a decision that was under way
    when it was turned off)."""
    if not engine["spec"]["autoscaling"]["enabled"]:
        return {}
    current = engine.get("status") or {}
    observed = engine["metadata"].get("generation")
    conditions = list(current.get("conditions", []))
    for condition in decision.conditions:
        conditions = set_condition(conditions, condition.type, condition.status, condition.reason,
                                   condition.message, observed, timestamp(now))
    new: dict[str, Any] = {"desiredReplicas": decision.replicas, "conditions": conditions}
    if decision.load is not None:
        new["metrics"] = {
            "kvCacheUsage": round(decision.load.kv_cache_usage, 4),
            "queueDepth": round(decision.load.queue_depth, 2),
            "observedAt": timestamp(datetime.datetime.fromtimestamp(decision.load.observed_at, datetime.UTC)),
        }
    if scaled:
        new["lastScaleTime"] = timestamp(now)
    return new


def condition(engine: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    """The engine's condition of type `kind`, or an empty one."""
    return next((c for c in (engine.get("status") or {}).get("conditions", []) if c.get("type") == kind), {})


def timestamp(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def changed(engine: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """Whether writing `status` would change anything (fields it lacks are left alone)."""
    current = engine.get("status") or {}
    return any(current.get(key) != value for key, value in status.items())


def standing_failure(engine: Mapping[str, Any]) -> str | None:
    """The reconcile failure recorded for the engine's current generation, if any."""
    for condition in (engine.get("status") or {}).get("conditions", []):
        if (
            condition.get("type") == READY
            and condition.get("reason") == RECONCILE_FAILED
            and condition.get("observedGeneration") == engine["metadata"].get("generation")
        ):
            return condition.get("message", "")
    return None


def rendered_generation(deployment: Mapping[str, Any]) -> int | None:
    value = deployment.get("metadata", {}).get("annotations", {}).get(naming.GENERATION_ANNOTATION)
    return int(value) if value is not None and value.isdigit() else None


def _behind(workload: Mapping[str, Any], kind: str, generation: int, *,
            why_unreported: str = "") -> _Verdict | None:
    """Why the workload does not show the current spec yet; None once its controller caught up."""
    rollout = workload.get("status") or {}
    if "observedGeneration" not in rollout:
        return _Verdict("Pending", f"{kind}Pending",
                        f"the {kind} controller has not acted on the {kind} yet{why_unreported}")
    if rendered_generation(workload) != generation:
        return _Verdict("Progressing", "Reconciling", f"generation {generation} is not applied to the {kind} yet")
    if rollout["observedGeneration"] < workload.get("metadata", {}).get("generation", 0):
        return _Verdict("Progressing", "RolloutPending",
                        f"the {kind} controller has not observed the new pod template yet")
    return None


def _judge_rollout(deployment: Mapping[str, Any], generation: int) -> _Verdict:
    behind = _behind(deployment, "Deployment", generation)
    if behind is not None:
        return behind
    rollout = deployment["status"]
    wanted = deployment.get("spec", {}).get("replicas", 1)
    available = rollout.get("availableReplicas", 0)
    refused = _deployment_condition(deployment, "ReplicaFailure")
    if refused.get("status") == "True" and available < wanted:
        # The API server refuses the pods (an unknown priority class, a quota, an admission
        # policy): no waiting fixes that, so say it now rather than at the progress deadline.
        why = f"the Deployment cannot create pods: {refused.get('message', refused.get('reason', ''))}"
        if available:
            return _Verdict("Degraded", FAILED_CREATE, f"{available}/{wanted} replicas are available; {why}")
        return _Verdict("Failed", FAILED_CREATE, why)

    deployment_progress = _deployment_condition(deployment, "Progressing")
    if deployment_progress.get("reason") == "ProgressDeadlineExceeded":
        return _Verdict("Failed", "ProgressDeadlineExceeded",
                        deployment_progress.get("message", "the rollout stalled"))

    updated = rollout.get("updatedReplicas", 0)
    total = rollout.get("replicas", 0)
    if updated < wanted or total > updated:
        return _Verdict("Progressing", "RollingOut",
                        f"{updated}/{wanted} replicas run the current pod template;"
                        f" {total - updated} old replicas remain")
    if wanted == 0:
        return _Verdict("Pending", SCALED_TO_ZERO, "spec.replicas is 0: no engine is running")
    if available < wanted:
        # Once the Deployment has called its rollout complete, missing replicas are lost ones,
        # not new ones still starting.
        if deployment_progress.get("reason") == "NewReplicaSetAvailable":
            return _Verdict("Degraded", "ReplicasUnavailable", f"{available}/{wanted} replicas are available",
                            rolled_out=True)
        return _Verdict("Progressing", "RollingOut", f"{available}/{wanted} updated replicas are available")
    return _Verdict("Ready", "Available", f"{available}/{wanted} replicas are available", rolled_out=True)


def _rolled_out(current: Mapping[str, Any], generation: int | None) -> bool:
    """Whether status already recorded a finished rollout of this generation."""
    progressing = next((c for c in current.get("conditions", []) if c.get("type") == PROGRESSING), {})
    return progressing.get("reason") == "RolloutComplete" and progressing.get("observedGeneration") == generation


def _judge_groups(lws: Mapping[str, Any], generation: int, *, rolled_out_before: bool) -> _Verdict:
    """A LeaderWorkerSet's rollout, in groups. LeaderWorkerSet tells no new group still starting
    from a lost one, so status does: once this generation rolled out, a group missing is lost."""
    behind = _behind(lws, render_lws.KIND, generation, why_unreported=(
        f" (it reports status.observedGeneration from LeaderWorkerSet {render_lws.OLDEST_VERSION} on)"))
    if behind is not None:
        return behind
    rollout = lws["status"]
    wanted = lws.get("spec", {}).get("replicas", 1)
    updated = rollout.get("updatedReplicas", 0)
    total = rollout.get("replicas", 0)
    ready = rollout.get("readyReplicas", 0)
    if updated < wanted or total > wanted:
        return _Verdict("Progressing", "RollingOut",
                        f"{updated}/{wanted} groups run the current pod templates ({total} groups exist)")
    if wanted == 0:
        return _Verdict("Pending", SCALED_TO_ZERO, "spec.replicas is 0: no engine is running")
    if ready < wanted:
        if rolled_out_before:
            return _Verdict("Degraded", "ReplicasUnavailable", f"{ready}/{wanted} groups are ready", rolled_out=True)
        return _Verdict("Progressing", "RollingOut", f"{ready}/{wanted} updated groups are ready")
    return _Verdict("Ready", "Available", f"{ready}/{wanted} groups are ready", rolled_out=True)


def _judge_routers(routers: Mapping[str, Any] | None) -> tuple[bool, str, str]:
    """RouterReady's status, reason and message: True while at least one router is available
    (they are active-active, so one serves every request)."""
    if routers is None:
        return False, "RouterDeploymentMissing", "the routers' Deployment does not exist yet"
    wanted = routers.get("spec", {}).get("replicas", 1)
    available = (routers.get("status") or {}).get("availableReplicas", 0)
    if available == 0:
        return False, "NoRouterAvailable", f"0/{wanted} routers are available"
    return True, "RoutersAvailable", f"{available}/{wanted} routers are available"


def _deployment_condition(deployment: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    for condition in (deployment.get("status") or {}).get("conditions", []):
        if condition.get("type") == kind:
            return condition
    return {}


def set_condition(
    conditions: list[dict[str, Any]],
    kind: str,
    true: bool,
    reason: str,
    message: str,
    observed: int | None,
    stamp: str,
) -> list[dict[str, Any]]:
    """Set one condition, keeping the others (later work adds its own types) and keeping
    lastTransitionTime unless the condition's status flips."""
    status = "True" if true else "False"
    previous = next((c for c in conditions if c.get("type") == kind), None)
    condition: dict[str, Any] = {"type": kind, "status": status, "reason": reason, "message": message}
    if observed is not None:
        condition["observedGeneration"] = observed
    if previous is not None and previous.get("status") == status and "lastTransitionTime" in previous:
        condition["lastTransitionTime"] = previous["lastTransitionTime"]
    else:
        condition["lastTransitionTime"] = stamp
    if previous is None:
        return [*conditions, condition]
    return [condition if c is previous else c for c in conditions]
