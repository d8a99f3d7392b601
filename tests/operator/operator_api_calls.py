"""The API rights the real operator uses, recorded from the requests the emulated API server
receives in a scenario that runs each code path, and the rights a list of RBAC PolicyRules grants.
Both are sets of (apiGroup, resource[/subresource], verb), as the API server's authorizer sees them.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fake_metrics import fake_metrics
from fake_pods import FakePod, serving
from operator_harness import NAMESPACE, TEST_CLIENT, Cluster, child, cluster, created, eventually, operator, phase_is, run

Right = tuple[str, str, str]
# Rights the operator holds only to grant them, in the routers' Role: the API server refuses a
# Role that grants more than its maker holds.
GRANTED_TO_ROUTERS: set[Right] = {("discovery.k8s.io", "endpointslices", "list"),
                                  ("discovery.k8s.io", "endpointslices", "watch")}


def granted(rules: Iterable[dict[str, Any]]) -> set[Right]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def recorded_calls(tmp_path: Path) -> set[Right]:
    """Every right the operator needs while it creates an engine's children (ServiceMonitor
    included), follows a spec change and a rollout, recreates a deleted Deployment, adds the
    routers (their ServiceAccount, Role and RoleBinding) and removes them, runs the engine over
    two pods (a LeaderWorkerSet in place of the Deployment, recreated once deleted) and back on
    one, autoscales up and down,
    reading the pods directly and then through Prometheus, and tunes the scheduling policy."""
    async def scenario() -> set[Right]:
        pod = FakePod(token=None)
        async with cluster(tmp_path, service_monitors=True, leader_worker_sets=True) as k, fake_metrics() as fake, serving(pod=pod) as urls, \
                operator(pod_metrics_url=fake.pod_url, pod_url=lambda _: urls["pod"]):
            await created(k)
            await eventually(lambda: child(k, "ServiceMonitor"), "every child")
            await k.update_engine("qwen", lambda spec: spec.update(image="ghcr.io/kvpilot/kvpilot:0.2.0"))
            await eventually(lambda: k.deployment("qwen")["metadata"]["generation"] == 2, "the new template")
            await k.roll_out("qwen")
            await eventually(lambda: phase_is(k, "Ready", 2), "Ready")
            await k.delete(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/qwen")
            await eventually(lambda: k.deployment("qwen"), "the recreated Deployment")
            await k.update_engine("qwen", lambda spec: spec.update(routing={"enabled": True}))
            await eventually(lambda: k.deployment("qwen-router"), "the routers")
            await k.update_engine("qwen", lambda spec: spec.update(routing={"enabled": False}))
            await eventually(lambda: k.deployment("qwen-router") is None, "the routers gone")
            await k.update_engine("qwen", lambda spec: spec.update(parallelism={"tensor": 2, "nodes": 2}))
            await eventually(lambda: k.leader_worker_set("qwen") and k.deployment("qwen") is None,
                             "the LeaderWorkerSet in place of the Deployment")
            await k.delete(f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NAMESPACE}/leaderworkersets/qwen-lws")
            await eventually(lambda: k.leader_worker_set("qwen"), "the recreated LeaderWorkerSet")
            await k.update_engine("qwen", lambda spec: spec.update(parallelism={"tensor": 1, "nodes": 1}))
            await eventually(lambda: k.deployment("qwen") and k.leader_worker_set("qwen") is None,
                             "the Deployment back")

            await k.create_pod("qwen-a", "qwen", ready=True)
            fake.set(["qwen-a"], kv=1.0)
            await k.update_engine("qwen", lambda spec: spec.update(replicas=1, autoscaling={
                "enabled": True, "maxReplicas": 2, "intervalSeconds": 1}))
            await eventually(lambda: k.engine("qwen")["spec"]["replicas"] == 2, "a scale-up")
            await k.update_engine("qwen", lambda spec: spec["autoscaling"].update(prometheus={"url": fake.url}))
            await eventually(lambda: fake.queries, "a Prometheus query")

            # At maxReplicas with a queue: the policy tuner switches the engine and its pod.
            fake.set(["qwen-a"], kv=1.0, waiting=50)
            await k.update_engine("qwen", lambda spec: spec["scheduling"].update(policy="auto"))
            await eventually(lambda: pod.switches == ["priority"], "the pod switched", timeout=20)

            # Idle, with a second pod: the scale-down marks the pod it removes first.
            await k.create_pod("qwen-b", "qwen", ready=True)
            fake.set(["qwen-a", "qwen-b"], kv=0.0)
            await k.update_engine("qwen", lambda spec: spec["autoscaling"].update(scaleDownStabilizationSeconds=0))
            await eventually(lambda: k.engine("qwen")["spec"]["replicas"] == 1, "a scale-down")
            return used(k)

    return run(scenario())


def used(k: Cluster) -> set[Right]:
    """The rights of every API request the operator made."""
    found = set()
    for request in k.server:
        if request.headers.get("User-Agent") == TEST_CLIENT or request.resource is None or not request.resource.plural:
            continue  # the tests' own requests, and discovery (open to every account)
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        for verb in _verbs(request):
            found.add((request.resource.group, resource, verb))
    return found


def _verbs(request: Any) -> list[str]:
    if request.method == "GET":
        return ["watch" if request.params.get("watch") == "true" else "get" if request.name else "list"]
    if request.method == "POST":
        return ["create"]
    if request.method == "PATCH":
        # A server-side apply that creates its object is authorized as create too.
        applied_anew = request.headers.get("Content-Type", "").startswith("application/apply-patch") \
            and request.action == "CREATE"
        return ["patch", "create"] if applied_anew else ["patch"]
    if request.method == "DELETE":
        return ["delete"]
    raise AssertionError(f"unexpected request {request.method} {request.url}")
