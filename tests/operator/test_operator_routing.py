"""Routing in the real kopf operator against the emulated API server: the routers' objects, their
status, and scale to zero and back on the routers' held requests (fake pod pages, pods made ready
by the test)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from fake_metrics import fake_metrics
from operator_harness import (
    CHILDREN, NAMESPACE, ROUTER_KINDS, SPEC, Cluster, child, cluster, condition, created, eventually, operator, run,
)

pytestmark = pytest.mark.timeout(90)

ROUTED = {**copy.deepcopy(SPEC), "routing": {"enabled": True}}
SCALE_TO_ZERO = {"enabled": True, "minReplicas": 0, "maxReplicas": 2, "intervalSeconds": 1,
                 "scaleToZeroAfterSeconds": 2}


def owned_objects(k: Cluster) -> dict[tuple[str, str], dict[str, Any]]:
    """Every live object the engine controls, by (kind, name)."""
    found = {}
    for obj in (o.raw for o in k.server.objects.values() if not o.deleted):
        refs = obj.get("metadata", {}).get("ownerReferences", [])
        if any(ref.get("kind") == "InferenceEngine" and ref.get("name") == "qwen" for ref in refs):
            found[obj["kind"], obj["metadata"]["name"]] = obj
    return found


def replicas(k: Cluster) -> int:
    return k.engine("qwen")["spec"]["replicas"]


def test_a_routed_engine_owns_its_routers_and_reports_them_ready(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, operator():
            await created(k, ROUTED)
            # The routers' PodDisruptionBudget is the last object a pass applies.
            await eventually(lambda: k.object(CHILDREN["PodDisruptionBudget"], "qwen-router"), "every object")
            assert k.object(ROUTER_KINDS["RoleBinding"], "qwen-router")["subjects"][0]["name"] == "qwen-router"
            assert set(owned_objects(k)) >= {
                ("Deployment", "qwen"), ("Deployment", "qwen-router"), ("Service", "qwen"),
                ("Service", "qwen-engines"), ("PodDisruptionBudget", "qwen"),
                ("PodDisruptionBudget", "qwen-router"), ("ServiceAccount", "qwen-router"), ("Role", "qwen-router"),
                ("RoleBinding", "qwen-router"), ("Secret", "qwen-cache-salt"),
            }
            salt = k.object(CHILDREN["Secret"], "qwen-cache-salt")["data"]["salt"]
            assert salt, "a salt was made"

            router_ready = lambda: condition(k.engine("qwen"), "RouterReady")  # noqa: E731
            assert (await eventually(router_ready, "RouterReady"))["status"] == "False"
            await k.roll_out("qwen-router")
            await eventually(lambda: router_ready()["status"] == "True", "RouterReady=True")
            assert router_ready()["reason"] == "RoutersAvailable"

            # The salt is kept: another pass (a rotated tenant key reconciles) leaves it as it was.
            await k.create_secret("other", {"x": "eQ=="})
            await k.patch(f"/api/v1/namespaces/{NAMESPACE}/secrets/prod-key", {"data": {"api-key": "bmV3"}})
            await eventually(lambda: k.object(CHILDREN["Secret"], "qwen-tenant-keys")["data"]["prod"] == "bmV3",
                             "the rotated key copied")
            assert k.object(CHILDREN["Secret"], "qwen-cache-salt")["data"]["salt"] == salt
            template = k.deployment("qwen")["spec"]["template"]
            assert {"name": "cache-salt", "secret": {"secretName": "qwen-cache-salt", "defaultMode": 0o440}} \
                in template["spec"]["volumes"]

    run(scenario())


def test_routing_off_renders_only_the_engines_objects(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, operator():
            await created(k)
            await eventually(lambda: all(child(k, kind) for kind in CHILDREN if kind != "ServiceMonitor"),
                             "every child")
            assert sorted(owned_objects(k)) == [
                ("ConfigMap", "qwen-config"), ("ConfigMap", "qwen-scheduling"), ("Deployment", "qwen"),
                ("PodDisruptionBudget", "qwen"), ("Secret", "qwen-admin-token"), ("Secret", "qwen-tenant-keys"),
                ("Service", "qwen"),
            ]
            await eventually(lambda: condition(k.engine("qwen"), "Ready"), "a status")
            assert condition(k.engine("qwen"), "RouterReady") == {}

    run(scenario())


def test_an_idle_engine_goes_to_zero_and_a_held_request_brings_it_back(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, fake_metrics() as fake, operator(pod_metrics_url=fake.pod_url):
            await k.create_pod("qwen-a", "qwen", ready=True)
            await k.create_pod("qwen-router-a", "qwen", ready=True, router=True)
            fake.set(["qwen-a"])
            fake.held["qwen-router-a"] = 0
            await created(k, {**ROUTED, "replicas": 1, "autoscaling": SCALE_TO_ZERO})
            await k.roll_out("qwen")
            await eventually(lambda: k.deployment("qwen-router"), "the routers")
            await k.roll_out("qwen-router")

            await eventually(lambda: replicas(k) == 0, "scaled to zero")
            (down,) = await eventually(lambda: k.events("ScaledDown"), "a ScaledDown event")
            assert down["message"].startswith("1 -> 0 replicas: idle for")
            await k.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/qwen-a")
            await eventually(lambda: k.deployment("qwen")["spec"]["replicas"] == 0, "the Deployment at 0")
            await k.roll_out("qwen")
            ready = await eventually(lambda: (c := condition(k.engine("qwen"), "Ready")).get("reason") == "ScaledToZero"
                                     and c, "Ready, scaled to zero")
            assert ready["status"] == "True"

            fake.held["qwen-router-a"] = 2
            await eventually(lambda: replicas(k) == 1, "scaled up from zero")
            (up,) = await eventually(lambda: k.events("ScaledUp"), "a ScaledUp event")
            assert up["message"] == "0 -> 1 replicas: the routers hold 2 requests and no replica runs"

    run(scenario())


def test_a_starting_pod_is_never_scaled_away(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, fake_metrics() as fake, operator(pod_metrics_url=fake.pod_url):
            await k.create_pod("qwen-a", "qwen", ready=True)
            await k.create_pod("qwen-b", "qwen", ready=False)  # loading its weights
            await k.create_pod("qwen-router-a", "qwen", ready=True, router=True)
            fake.set(["qwen-a", "qwen-b"])
            fake.held["qwen-router-a"] = 0
            await created(k, {**ROUTED, "replicas": 2, "autoscaling": SCALE_TO_ZERO})

            # Well past the idle window, the starting pod keeps the engine up.
            await eventually(lambda: condition(k.engine("qwen"), "MetricsAvailable").get("status") == "True",
                             "a reading")
            start = len([r for r in k.server if r.resource is not None and r.resource.plural == "pods"])
            await eventually(lambda: len([r for r in k.server if r.resource is not None
                                          and r.resource.plural == "pods"]) >= start + 8, "4 intervals")
            assert replicas(k) == 2 and not k.events("ScaledDown")

            await k.set_ready("qwen-b", True)
            await eventually(lambda: replicas(k) == 0, "scaled to zero once nothing starts")

    run(scenario())


def test_routing_turned_off_removes_the_routers(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, operator():
            await created(k, ROUTED)
            await eventually(lambda: k.object(CHILDREN["PodDisruptionBudget"], "qwen-router"), "the routers")
            await k.roll_out("qwen-router")
            await eventually(lambda: condition(k.engine("qwen"), "RouterReady").get("status") == "True", "RouterReady")

            await k.update_engine("qwen", lambda spec: spec["routing"].update(enabled=False))
            await eventually(lambda: set(owned_objects(k)) == {
                ("ConfigMap", "qwen-config"), ("ConfigMap", "qwen-scheduling"), ("Deployment", "qwen"),
                ("PodDisruptionBudget", "qwen"), ("Secret", "qwen-admin-token"), ("Secret", "qwen-tenant-keys"),
                ("Service", "qwen"),
            }, "only the engine's objects")
            assert k.object(CHILDREN["Service"], "qwen")["spec"]["selector"]["app.kubernetes.io/component"] == "engine"
            await eventually(lambda: condition(k.engine("qwen"), "RouterReady") == {}, "RouterReady dropped")
            deleted = await eventually(lambda: len(k.events("Deleted")) == 7 and k.events("Deleted"), "7 Deleted events")
            assert {event["message"] for event in deleted} >= {"Deleted Deployment qwen-router",
                                                                "Deleted Secret qwen-cache-salt"}

    run(scenario())
