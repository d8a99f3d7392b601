"""The chart's Roles and ClusterRole grant operator/rbac.yaml's rules, which are exactly the rights
the operator uses (recorded from its requests to the emulated API server), with no wildcard."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from crd_validation import REPO
from helm_cli import Helm
from operator_api_calls import GRANTED_TO_ROUTERS, Right, granted
from packaging_support import FULL_NAMESPACE, FULL_VALUES

OPERATOR_RULES = yaml.safe_load((REPO / "operator" / "rbac.yaml").read_text())


@pytest.fixture(scope="module")
def roles(helm: Helm) -> list[dict[str, Any]]:
    """The ClusterRole of a cluster-wide install, and the Roles of one limited to some namespaces
    (the Lease's Role apart: test_packaging_chart.py checks it)."""
    found = [
        manifest
        for manifests in (helm.template(), helm.template("--values", FULL_VALUES, namespace=FULL_NAMESPACE))
        for manifest in manifests
        if manifest["kind"] in ("ClusterRole", "Role") and not manifest["metadata"]["name"].endswith("-leader-election")
    ]
    assert sorted(role["kind"] for role in found) == ["ClusterRole", "Role", "Role"]
    return found


def test_rules_are_the_operators_rules(roles: list[dict[str, Any]]) -> None:
    for role in roles:
        assert role["rules"] == OPERATOR_RULES, role["kind"]


@pytest.mark.timeout(90)
def test_rules_cover_exactly_what_the_operator_calls(roles: list[dict[str, Any]], operator_calls: set[Right]) -> None:
    for role in roles:
        assert operator_calls - granted(role["rules"]) == set(), f"calls the {role['kind']} does not allow"
        assert granted(role["rules"]) - operator_calls == GRANTED_TO_ROUTERS, \
            f"rights in the {role['kind']} the operator never uses"


def test_no_wildcards(roles: list[dict[str, Any]]) -> None:
    for role in roles:
        for rule in role["rules"]:
            assert set(rule) == {"apiGroups", "resources", "verbs"}, "no nonResourceURLs or resourceNames"
            assert not [item for field in rule.values() for item in field if "*" in item], rule
