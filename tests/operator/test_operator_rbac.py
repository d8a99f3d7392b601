"""operator/rbac.yaml grants exactly the rights the operator uses: checked against every request
the real operator makes to the emulated API server in a scenario that runs each code path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from crd_validation import REPO
from operator_harness import (
    NAMESPACE, TEST_CLIENT, Cluster, child, cluster, created, eventually, operator, phase_is, run,
)

pytestmark = pytest.mark.timeout(90)

RULES = yaml.safe_load((REPO / "operator" / "rbac.yaml").read_text())


def granted() -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in RULES
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def used(k: Cluster) -> set[tuple[str, str, str]]:
    """(apiGroup, resource[/subresource], verb) of every API request the operator made, as the
    API server's authorizer sees it."""
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


def test_rules_use_no_wildcards() -> None:
    for rule in RULES:
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field] and all("*" not in item for item in rule[field]), rule
        assert set(rule) == {"apiGroups", "resources", "verbs"}, "namespaced rules only: no nonResourceURLs"


def test_rules_cover_exactly_what_the_operator_calls(tmp_path: Path) -> None:
    async def scenario() -> set[tuple[str, str, str]]:
        async with cluster(tmp_path, service_monitors=True) as k, operator():
            await created(k)
            await eventually(lambda: child(k, "ServiceMonitor"), "every child")
            await k.update_engine("qwen", lambda spec: spec.update(image="ghcr.io/kvpilot/kvpilot:0.2.0"))
            await eventually(lambda: k.deployment("qwen")["metadata"]["generation"] == 2, "the new template")
            await k.roll_out("qwen")
            await eventually(lambda: phase_is(k, "Ready", 2), "Ready")
            await k.delete(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/qwen")
            await eventually(lambda: k.deployment("qwen"), "the recreated Deployment")
            return used(k)

    calls = run(scenario())
    assert calls - granted() == set(), "calls the rules do not allow"
    assert granted() - calls == set(), "rights the operator never uses"
