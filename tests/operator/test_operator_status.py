"""Status: the child Deployment (or LeaderWorkerSet) -> phase, conditions and counts, never Ready too early."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from inference_engines import FULL_SPEC, engine
from kvpilot.operator import autoscaler, status

T0 = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
T1 = T0 + datetime.timedelta(minutes=5)


def deployment(
    *,
    rendered: int = 3,
    generation: int = 7,
    observed: int | None = 7,
    replicas: int = 2,
    total: int = 2,
    updated: int = 2,
    ready: int = 2,
    available: int = 2,
    progress_reason: str = "NewReplicaSetAvailable",
    progress_status: str = "True",
) -> dict[str, Any]:
    rollout: dict[str, Any] = {
        "replicas": total, "updatedReplicas": updated, "readyReplicas": ready, "availableReplicas": available,
        "conditions": [{"type": "Progressing", "status": progress_status, "reason": progress_reason,
                        "message": "progress message"}],
    }
    if observed is not None:
        rollout["observedGeneration"] = observed
    return {
        "metadata": {"name": "llama", "namespace": "ml", "generation": generation,
                     "annotations": {"kvpilot.dev/generation": str(rendered)}},
        "spec": {"replicas": replicas},
        "status": rollout,
    }


def condition(found: dict[str, Any], kind: str) -> dict[str, Any]:
    (match,) = [c for c in found["conditions"] if c["type"] == kind]
    return match


def test_ready_when_the_current_template_is_fully_available() -> None:
    found = status.derive(engine(), deployment(), now=T0)
    assert found["phase"] == "Ready"
    assert found["observedGeneration"] == 3
    assert (found["replicas"], found["readyReplicas"], found["desiredReplicas"]) == (2, 2, 2)
    assert found["selector"] == (
        "app.kubernetes.io/component=engine,app.kubernetes.io/instance=llama,app.kubernetes.io/name=kvpilot"
    )
    assert found["endpoint"] == "http://llama.ml.svc:80"
    assert found["effectiveSchedulingPolicy"] == "priority"
    assert condition(found, "Ready") == {
        "type": "Ready", "status": "True", "reason": "Available", "message": "2/2 replicas are available",
        "observedGeneration": 3, "lastTransitionTime": "2026-01-01T12:00:00Z",
    }
    assert condition(found, "Progressing")["status"] == "False"


@pytest.mark.parametrize(("rollout", "reason"), [
    ({"rendered": 2}, "Reconciling"),  # the Deployment still holds an older spec
    ({"observed": 6}, "RolloutPending"),  # its controller has not seen the new template
    ({"updated": 1, "available": 1, "ready": 1}, "RollingOut"),  # one pod still runs the old template
    ({"total": 3}, "RollingOut"),  # an old pod is still terminating
    ({"available": 1, "ready": 1, "progress_reason": "ReplicaSetUpdated"}, "RollingOut"),  # new pod not up yet
])
def test_progressing_while_the_rollout_is_not_done(rollout: dict[str, Any], reason: str) -> None:
    found = status.derive(engine(), deployment(**rollout), now=T0)
    assert found["phase"] == "Progressing"
    assert condition(found, "Ready")["status"] == "False"
    assert condition(found, "Progressing") | {"message": ""} == {
        "type": "Progressing", "status": "True", "reason": reason, "message": "",
        "observedGeneration": rollout.get("rendered", 3), "lastTransitionTime": "2026-01-01T12:00:00Z",
    }


def test_pending_before_the_deployment_controller_acts() -> None:
    found = status.derive(engine(), deployment(observed=None), now=T0)
    assert found["phase"] == "Pending"
    assert condition(found, "Ready")["reason"] == "DeploymentPending"


def test_degraded_when_a_finished_rollout_loses_a_replica() -> None:
    found = status.derive(engine(), deployment(available=1, ready=1), now=T0)
    assert found["phase"] == "Degraded"
    assert condition(found, "Ready")["status"] == "False"
    assert condition(found, "Ready")["reason"] == "ReplicasUnavailable"
    assert condition(found, "Progressing")["status"] == "False"


def test_failed_when_the_rollout_exceeds_its_deadline() -> None:
    found = status.derive(
        engine(), deployment(updated=1, progress_reason="ProgressDeadlineExceeded", progress_status="False"), now=T0
    )
    assert found["phase"] == "Failed"
    assert condition(found, "Ready")["reason"] == "ProgressDeadlineExceeded"
    assert condition(found, "Ready")["message"] == "progress message"


NO_PRIORITY_CLASS = 'pods "llama-7d9f-" is forbidden: no PriorityClass with name gpu-high was found'


def pods_not_created(**rollout: Any) -> dict[str, Any]:
    """The Deployment as its controller reports a ReplicaSet whose pods the API server refuses."""
    found = deployment(progress_reason="ReplicaSetUpdated", **rollout)
    found["status"]["conditions"].append({"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                                          "message": NO_PRIORITY_CLASS})
    return found


def test_failed_at_once_when_no_pod_can_be_created() -> None:
    # An unknown priority class (or a quota, or a policy) refuses every pod: say so now, not after
    # the 30-minute progress deadline.
    found = status.derive(engine(), pods_not_created(total=0, updated=0, ready=0, available=0), now=T0)
    assert found["phase"] == "Failed"
    assert condition(found, "Ready") | {"lastTransitionTime": ""} == {
        "type": "Ready", "status": "False", "reason": "FailedCreate",
        "message": f"the Deployment cannot create pods: {NO_PRIORITY_CLASS}",
        "observedGeneration": 3, "lastTransitionTime": "",
    }
    assert condition(found, "Progressing")["reason"] == "FailedCreate"


def test_degraded_when_new_pods_cannot_be_created_but_some_serve() -> None:
    found = status.derive(engine(), pods_not_created(replicas=4, total=2, updated=2, ready=2, available=2), now=T0)
    assert found["phase"] == "Degraded"
    assert condition(found, "Ready")["reason"] == "FailedCreate"
    assert condition(found, "Ready")["message"].startswith("2/4 replicas are available; the Deployment cannot")


def test_scaled_to_zero_is_not_ready() -> None:
    found = status.derive(engine(), deployment(replicas=0, total=0, updated=0, ready=0, available=0), now=T0)
    assert found["phase"] == "Pending"
    assert condition(found, "Ready")["reason"] == "ScaledToZero"


def test_a_reconcile_failure_stands_until_the_spec_changes() -> None:
    failed = engine()
    failed["status"] = status.derive(failed, deployment(), now=T0, failure="422 Invalid: bad quantity")
    assert failed["status"]["phase"] == "Failed"
    assert condition(failed["status"], "Ready")["message"] == "422 Invalid: bad quantity"

    # A Deployment event for the same generation keeps the failure ...
    assert status.derive(failed, deployment(), now=T1)["phase"] == "Failed"
    # ... and a new generation clears it.
    newer = engine(generation=4)
    newer["status"] = failed["status"]
    assert status.derive(newer, deployment(rendered=4), now=T1)["phase"] == "Ready"


def test_transition_time_changes_only_on_transition() -> None:
    obj = engine()
    obj["status"] = status.derive(obj, deployment(updated=1, available=1, ready=1), now=T0)
    later = status.derive(obj, deployment(updated=2, available=1, ready=1, progress_reason="ReplicaSetUpdated"), now=T1)
    # Still progressing, with a new message: the transition time stays.
    assert condition(later, "Progressing")["lastTransitionTime"] == "2026-01-01T12:00:00Z"
    assert condition(later, "Progressing")["message"] != condition(obj["status"], "Progressing")["message"]
    obj["status"] = later
    done = status.derive(obj, deployment(), now=T1)
    assert condition(done, "Ready")["lastTransitionTime"] == "2026-01-01T12:05:00Z"
    assert condition(done, "Progressing")["lastTransitionTime"] == "2026-01-01T12:05:00Z"


def test_unchanged_inputs_give_an_unchanged_status() -> None:
    obj = engine()
    obj["status"] = status.derive(obj, deployment(), now=T0)
    again = status.derive(obj, deployment(), now=T1)
    assert not status.changed(obj, again)
    assert status.changed(obj, status.derive(obj, deployment(available=1), now=T1))


def test_conditions_of_other_writers_are_kept() -> None:
    obj = autoscaled()
    scaling = {"type": "ScalingLimited", "status": "True", "reason": "AtMax", "message": "m",
               "lastTransitionTime": "2025-12-31T00:00:00Z"}
    obj["status"] = {"conditions": [scaling]}
    found = status.derive(obj, deployment(), now=T0)
    assert [c["type"] for c in found["conditions"]] == ["ScalingLimited", "Ready", "Progressing"]
    assert found["conditions"][0] == scaling


def test_auto_policy_reports_the_tuners_choice() -> None:
    spec = engine()["spec"]
    spec["scheduling"]["policy"] = "auto"
    obj = engine(spec)
    assert status.derive(obj, deployment(), now=T0)["effectiveSchedulingPolicy"] == "fcfs"
    obj["status"] = {"effectiveSchedulingPolicy": "priority"}
    assert status.derive(obj, deployment(), now=T0)["effectiveSchedulingPolicy"] == "priority"


def decision(replicas: int, *, available: bool = True, load: bool = True) -> autoscaler.Decision:
    conditions = (
        autoscaler.Condition("MetricsAvailable", True, "MetricsRead", "read 2 ready replicas"),
        autoscaler.Condition("ScalingLimited", False, "DesiredWithinRange", "within"),
    ) if available else (autoscaler.Condition("MetricsAvailable", False, "MetricsMissing", "no sample of pod p"),)
    reading = autoscaler.Load(kv_cache_usage=0.123456, queue_depth=2.3333, saturation=1.2,
                              observed_at=T0.timestamp() - 3) if load else None
    return autoscaler.Decision(replicas, "", "", conditions, reading, ())


def autoscaled(enabled: bool = True) -> dict[str, Any]:
    spec = engine()["spec"]
    spec["autoscaling"].update(enabled=enabled, maxReplicas=4)
    return engine(spec)


def test_autoscaler_status_records_the_reading_the_decision_and_its_conditions() -> None:
    found = status.autoscaling(autoscaled(), decision(4), now=T0, scaled=True)
    assert found["desiredReplicas"] == 4
    assert found["metrics"] == {"kvCacheUsage": 0.1235, "queueDepth": 2.33, "observedAt": "2026-01-01T11:59:57Z"}
    assert found["lastScaleTime"] == "2026-01-01T12:00:00Z"
    assert condition(found, "MetricsAvailable") == {
        "type": "MetricsAvailable", "status": "True", "reason": "MetricsRead", "message": "read 2 ready replicas",
        "observedGeneration": 3, "lastTransitionTime": "2026-01-01T12:00:00Z",
    }
    assert condition(found, "ScalingLimited")["status"] == "False"

    # Metrics lost later: the condition flips (a new transition time), ScalingLimited and the last
    # reading stay as they were, and no scale time is written.
    before = {**autoscaled(), "status": found}
    later = status.autoscaling(before, decision(4, available=False, load=False), now=T1, scaled=False)
    assert "metrics" not in later and "lastScaleTime" not in later
    assert condition(later, "MetricsAvailable")["lastTransitionTime"] == "2026-01-01T12:05:00Z"
    assert condition(later, "ScalingLimited") == condition(found, "ScalingLimited")
    still = status.autoscaling({**before, "status": later}, decision(4, available=False, load=False),
                               now=T1 + (T1 - T0), scaled=False)
    assert condition(still, "MetricsAvailable")["lastTransitionTime"] == "2026-01-01T12:05:00Z"


def test_missing_tenant_keys_degrade_the_engine_until_a_pass_finds_them() -> None:
    problems = ["tenant prod: Secret prod-key does not exist"]
    found = status.derive(engine(), deployment(), now=T0, problems=problems)
    degraded = condition(found, "Degraded")
    assert (degraded["status"], degraded["reason"], degraded["message"]) == ("True", "TenantKeyMissing", problems[0])
    assert found["phase"] == "Ready"  # it serves, without the tenant whose key is missing
    # A refresh that did not look (the Deployment follower) leaves the condition as it was.
    observed = {**engine(), "status": found}
    kept = status.derive(observed, deployment(), now=T0)
    assert condition(kept, "Degraded") == degraded
    cleared = status.derive(observed, deployment(), now=T0, problems=[])
    assert condition(cleared, "Degraded")["status"] == "False"


def test_turning_autoscaling_off_drops_its_conditions_and_reading() -> None:
    # They would stand still once the autoscaler stops: a ScalingLimited=True, a KV% column, both
    # from whenever it last ran.
    scaled = autoscaled()
    scaled["status"] = status.derive(scaled, deployment(), now=T0)
    scaled["status"] |= status.autoscaling(scaled, decision(2), now=T0, scaled=False)
    assert {c["type"] for c in scaled["status"]["conditions"]} >= {"MetricsAvailable", "ScalingLimited"}
    scaled["spec"] = autoscaled(enabled=False)["spec"]
    found = status.derive(scaled, deployment(), now=T1)
    assert {c["type"] for c in found["conditions"]} == {"Ready", "Progressing"}
    assert found["metrics"] is None  # a merge patch's null: the field goes
    again = {**scaled, "status": {key: value for key, value in {**scaled["status"], **found}.items()
                                  if value is not None}}
    assert "metrics" not in status.derive(again, deployment(), now=T1)
    # A decision that was under way when autoscaling was turned off records nothing.
    assert status.autoscaling(again, decision(2), now=T1, scaled=False) == {}


def over_pods() -> dict[str, Any]:
    return engine({**FULL_SPEC, "parallelism": {"tensor": 2, "nodes": 2}})


def groups(*, observed: int | None = 7, ready: int = 2, updated: int = 2, total: int = 2) -> dict[str, Any]:
    """The engine's LeaderWorkerSet, two groups wanted, as its controller reports it."""
    lws = deployment(observed=observed, total=total, updated=updated, ready=ready)
    lws["kind"] = "LeaderWorkerSet"
    del lws["status"]["availableReplicas"], lws["status"]["conditions"]
    return lws


def test_an_engine_over_pods_counts_ready_groups() -> None:
    found = status.derive(over_pods(), groups(), now=T0)
    assert (found["phase"], found["replicas"], found["readyReplicas"]) == ("Ready", 2, 2)
    assert condition(found, "Ready")["message"] == "2/2 groups are ready"
    # The leaders alone, as the scale subresource's selector: each one stands for its group.
    assert found["selector"] == (
        "app.kubernetes.io/component=engine,app.kubernetes.io/instance=llama,app.kubernetes.io/name=kvpilot"
    )


@pytest.mark.parametrize(("lws", "phase", "reason"), [
    (groups(observed=None), "Pending", "LeaderWorkerSetPending"),
    (groups(observed=6), "Progressing", "RolloutPending"),
    (groups(updated=1), "Progressing", "RollingOut"),
    (groups(total=3), "Progressing", "RollingOut"),
    (groups(ready=1), "Progressing", "RollingOut"),
    (None, "Pending", "LeaderWorkerSetMissing"),
])
def test_an_engine_over_pods_is_not_ready_before_every_group_is(lws: dict[str, Any] | None, phase: str,
                                                                  reason: str) -> None:
    found = status.derive(over_pods(), lws, now=T0)
    assert (found["phase"], condition(found, "Ready")["reason"]) == (phase, reason)


def test_a_group_lost_after_the_rollout_degrades_the_engine() -> None:
    obj = over_pods()
    obj["status"] = status.derive(obj, groups(), now=T0)
    found = status.derive(obj, groups(ready=1), now=T1)
    assert (found["phase"], condition(found, "Ready")["reason"], found["readyReplicas"]) == \
        ("Degraded", "ReplicasUnavailable", 1)


def test_without_leader_worker_set_the_engine_says_what_to_install() -> None:
    message = "install LeaderWorkerSet"
    found = status.derive(over_pods(), None, now=T0, unserved=message, problems=[])
    assert (condition(found, "Degraded")["status"], condition(found, "Degraded")["reason"]) == \
        ("True", "LeaderWorkerSetMissing")
    assert condition(found, "Degraded")["message"] == condition(found, "Ready")["message"] == message
    assert found["phase"] == "Pending"
