"""An engine over several pods in the real kopf operator against the emulated API server: with
LeaderWorkerSet served, a LeaderWorkerSet in place of the Deployment, scaled and followed in
groups; without it, Degraded and nothing applied."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from fake_metrics import fake_metrics
from operator_harness import (CHILDREN, SPEC, Cluster, child, cluster, condition, created, eventually, key, operator,
                              phase_is, run)

pytestmark = pytest.mark.timeout(90)

TWO_PODS = {**SPEC, "parallelism": {"tensor": 2, "nodes": 2}}


def lws_replicas(k: Cluster) -> int | None:
    lws = k.leader_worker_set("qwen")
    return None if lws is None else lws["spec"]["replicas"]


async def created_over_pods(k: Cluster, spec: dict[str, Any] = TWO_PODS) -> dict[str, Any]:
    await k.create_secret("prod-key", {"api-key": key("sk-prod")})
    await k.create_engine("qwen", spec)
    return await eventually(lambda: k.leader_worker_set("qwen"), "the LeaderWorkerSet")


def test_the_engine_runs_as_a_leader_worker_set_in_ready_groups(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, leader_worker_sets=True) as k, operator():
            lws = await created_over_pods(k)
            assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
            await eventually(lambda: child(k, "PodDisruptionBudget"), "the other children")
            assert k.deployment("qwen") is None
            await eventually(lambda: k.engine("qwen").get("status", {}).get("phase") == "Pending", "Pending")

            await k.report_groups("qwen", ready=1)
            await eventually(lambda: k.engine("qwen")["status"].get("readyReplicas") == 1, "1 ready group")
            assert k.engine("qwen")["status"]["phase"] == "Progressing"
            await k.report_groups("qwen")
            await eventually(lambda: phase_is(k, "Ready", 1), "Ready")
            status = k.engine("qwen")["status"]
            assert (status["replicas"], status["readyReplicas"]) == (2, 2)
            assert condition(k.engine("qwen"), "Ready")["message"] == "2/2 groups are ready"

            # A group lost after the rollout: Degraded, one ready group.
            await k.report_groups("qwen", ready=1)
            await eventually(lambda: k.engine("qwen")["status"]["phase"] == "Degraded", "Degraded")
            assert condition(k.engine("qwen"), "Ready")["reason"] == "ReplicasUnavailable"
            assert k.engine("qwen")["status"]["readyReplicas"] == 1

            # kubectl scale ie (or the autoscaler, which writes the same subresource): the groups follow.
            await k.scale("qwen", 3)
            await eventually(lambda: lws_replicas(k) == 3, "3 groups")

    run(scenario())


def test_the_autoscaler_reads_the_leaders_alone_and_scales_the_groups(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, leader_worker_sets=True) as k, fake_metrics() as fake, \
                operator(pod_metrics_url=fake.pod_url):
            spec = copy.deepcopy(TWO_PODS)
            spec.update(replicas=1, autoscaling={"enabled": True, "maxReplicas": 4, "targetKVCacheUsage": 0.5,
                                                 "intervalSeconds": 1})
            # A leader at KV 0.9, and its worker, which serves no metrics: were it read, the reading
            # would fail and nothing would scale.
            await k.create_pod("qwen-lws-0", "qwen", ready=True)
            await k.create_pod("qwen-lws-0-1", "qwen", ready=True, worker=True)
            fake.set(["qwen-lws-0"], kv=0.9)
            await created_over_pods(k, spec)
            # 0.9 / 0.5 on one group: 2 groups.
            await eventually(lambda: lws_replicas(k) == 2, "the LeaderWorkerSet at 2 groups")
            assert k.engine("qwen")["spec"]["replicas"] == 2

            # Idle: back to one group. LeaderWorkerSet removes the highest-indexed group, so no pod
            # is marked to go first, as a Deployment's would be.
            await k.create_pod("qwen-lws-1", "qwen", ready=True)
            fake.set(["qwen-lws-0", "qwen-lws-1"], kv=0.0)
            await k.update_engine("qwen", lambda spec: spec["autoscaling"].update(scaleDownStabilizationSeconds=0))
            await eventually(lambda: lws_replicas(k) == 1, "the LeaderWorkerSet back at 1 group")
            for pod in ("qwen-lws-0", "qwen-lws-1"):
                assert not (k.object("v1/pods", pod)["metadata"].get("annotations") or {}), pod

    run(scenario())


def test_changing_the_nodes_swaps_the_workload_kind(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, leader_worker_sets=True) as k, operator():
            await created(k)
            await k.update_engine("qwen", lambda spec: spec.update(parallelism={"tensor": 2, "nodes": 2}))
            await eventually(lambda: k.leader_worker_set("qwen") and k.deployment("qwen") is None,
                             "the LeaderWorkerSet in place of the Deployment")
            await k.update_engine("qwen", lambda spec: spec.update(parallelism={"tensor": 2}))
            await eventually(lambda: k.deployment("qwen") and k.leader_worker_set("qwen") is None,
                             "the Deployment in place of the LeaderWorkerSet")
            await eventually(lambda: len(k.events("Deleted")) == 2, "a Deleted event for each")

    run(scenario())


def test_without_leader_worker_set_the_engine_is_degraded_and_nothing_is_applied(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, operator():
            await k.create_secret("prod-key", {"api-key": key("sk-prod")})
            await k.create_engine("qwen", TWO_PODS)
            degraded = await eventually(lambda: condition(k.engine("qwen"), "Degraded"), "Degraded")
            assert (degraded["status"], degraded["reason"]) == ("True", "LeaderWorkerSetMissing")
            assert "install LeaderWorkerSet v0.9.0 or later (tested with v0.10.0), then restart the operator" \
                in degraded["message"]
            assert condition(k.engine("qwen"), "Ready")["reason"] == "LeaderWorkerSetMissing"
            await eventually(lambda: k.events("LeaderWorkerSetMissing"), "a warning Event")
            assert [kind for kind in CHILDREN if child(k, kind) is not None] == []

    run(scenario())


def test_without_leader_worker_set_a_running_engine_keeps_its_pods(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, operator():
            deployment = await created(k)
            await eventually(lambda: child(k, "PodDisruptionBudget"), "every child")
            config = child(k, "ConfigMap")
            await k.update_engine("qwen", lambda spec: spec.update(parallelism={"tensor": 2, "nodes": 2}))
            await eventually(lambda: condition(k.engine("qwen"), "Degraded").get("reason") == "LeaderWorkerSetMissing",
                             "Degraded")
            # Not even the engine's arguments in its ConfigMap: the running pods serve the spec before.
            assert k.deployment("qwen")["metadata"]["generation"] == deployment["metadata"]["generation"]
            assert child(k, "ConfigMap") == config

    run(scenario())
