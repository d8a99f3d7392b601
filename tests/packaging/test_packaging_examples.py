"""examples/*.yaml: every document is one the API server accepts, each example shows what its name
promises, and the real operator, given each example, writes only valid objects."""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import pytest

from crd_validation import REPO, engine_schema, with_defaults
from kvpilot.operator import naming, render_lws
from operator_harness import CHILDREN, Cluster, cluster, eventually, operator, run
from packaging_support import validate, yaml_documents

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
Manifest = dict[str, Any]


def engines(documents: list[Manifest]) -> list[Manifest]:
    return [doc for doc in documents if doc["kind"] == naming.KIND]


def test_the_examples_are_there() -> None:
    assert {path.name for path in EXAMPLES} >= {"engine.yaml", "engine-tenants.yaml", "engine-autoscaling.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_every_document_is_accepted(path: Path) -> None:
    documents = yaml_documents(path)
    assert engines(documents), "every example declares an engine"
    for document in documents:
        validate(document)


def test_the_tenants_example_gives_each_tenant_a_key_and_a_priority() -> None:
    (engine,) = engines(yaml_documents(REPO / "examples" / "engine-tenants.yaml"))
    scheduling = with_defaults(engine)["spec"]["scheduling"]
    assert scheduling["policy"] == "priority"
    tenants = scheduling["tenants"]
    assert len(tenants) >= 2
    assert len({tenant["priority"] for tenant in tenants}) == len(tenants)
    assert all("apiKeySecretRef" in tenant for tenant in tenants)


def test_the_autoscaling_example_spells_out_every_setting() -> None:
    path = REPO / "examples" / "engine-autoscaling.yaml"
    (engine,) = engines(yaml_documents(path))
    autoscaling = engine["spec"]["autoscaling"]
    assert autoscaling["enabled"] is True
    declared = engine_schema()["properties"]["spec"]["properties"]["autoscaling"]["properties"]
    # The Prometheus URL is optional (the operator scrapes the pods without it): shown commented out.
    assert set(declared) - set(autoscaling) == {"prometheus"}
    assert "# prometheus:" in path.read_text()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_the_operator_writes_valid_objects_for_every_example(path: Path, tmp_path: Path) -> None:
    documents = yaml_documents(path)
    assert {doc["kind"] for doc in documents} <= {"Secret", naming.KIND}, "apply the other kinds here too"

    async def scenario() -> list[Manifest]:
        # No ServiceMonitor API: kubernetes-validate has no schema for that kind. LeaderWorkerSets,
        # for the engines over several pods.
        async with cluster(tmp_path, leader_worker_sets=True) as k, operator():
            for secret in (doc for doc in documents if doc["kind"] == "Secret"):
                await k.create_secret(secret["metadata"]["name"], stored_data(secret))
            for engine in engines(documents):
                await k.create_engine(engine["metadata"]["name"], engine["spec"])
            for engine in engines(documents):
                # The operator applies the (routers') PodDisruptionBudget after every other child.
                last = naming.router_name(engine["metadata"]["name"])
                await eventually(lambda last=last: k.object(CHILDREN["PodDisruptionBudget"], last), f"{last}'s children")
            return written_by_the_operator(k)

    written = run(scenario())
    for engine in engines(documents):
        name = engine["metadata"]["name"]
        mine = {(obj["kind"], obj["metadata"]["name"]): obj for obj in written if naming.owner_name(obj) == name}
        router = naming.router_name(name)
        _, kind, workload = render_lws.workload(with_defaults({**engine, "metadata": {"name": name}}))
        assert sorted(mine) == sorted([
            ("ConfigMap", f"{name}-config"), ("ConfigMap", f"{name}-scheduling"), (kind, workload),
            ("Deployment", router), ("PodDisruptionBudget", name), ("PodDisruptionBudget", router),
            ("Role", router), ("RoleBinding", router), ("Secret", f"{name}-admin-token"),
            ("Secret", f"{name}-cache-salt"), ("Secret", f"{name}-tenant-keys"), ("Service", name),
            ("Service", f"{name}-engines"), ("ServiceAccount", router),
        ]), "every example runs with its routers (the default)"
        keyed = {t["name"] for t in engine["spec"].get("scheduling", {}).get("tenants", []) if "apiKeySecretRef" in t}
        assert set(mine["Secret", f"{name}-tenant-keys"].get("data", {})) == keyed, "every tenant's key was found in its Secret"
    for obj in written:
        validate(obj)


def stored_data(secret: Manifest) -> dict[str, str]:
    """A Secret's data as the API server stores it: stringData is encoded and merged into data."""
    encoded = {key: base64.b64encode(value.encode()).decode() for key, value in secret.get("stringData", {}).items()}
    return {**secret.get("data", {}), **encoded}


def written_by_the_operator(k: Cluster) -> list[Manifest]:
    return [
        copy.deepcopy(obj.raw) for obj in k.server.objects.values()
        if not obj.deleted and obj.raw["metadata"].get("labels", {}).get(naming.MANAGED_BY_LABEL) == naming.FIELD_MANAGER
    ]
