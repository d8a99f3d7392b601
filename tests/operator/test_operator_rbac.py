"""operator/rbac.yaml grants exactly the rights the operator uses: checked against every request
the real operator makes to the emulated API server in a scenario that runs each code path."""

from __future__ import annotations

import pytest
import yaml

from crd_validation import REPO
from inference_engines import FULL_SPEC, engine
from kvpilot.operator import render
from operator_api_calls import GRANTED_TO_ROUTERS, Right, granted

pytestmark = pytest.mark.timeout(90)

RULES = yaml.safe_load((REPO / "operator" / "rbac.yaml").read_text())


def test_rules_use_no_wildcards() -> None:
    for rule in RULES:
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field] and all("*" not in item for item in rule[field]), rule
        assert set(rule) == {"apiGroups", "resources", "verbs"}, "namespaced rules only: no nonResourceURLs"


def test_rules_cover_exactly_what_the_operator_calls(operator_calls: set[Right]) -> None:
    assert operator_calls - granted(RULES) == set(), "calls the rules do not allow"
    assert granted(RULES) - operator_calls == GRANTED_TO_ROUTERS, "rights the operator never uses"


def test_the_operator_holds_every_right_it_grants_the_routers() -> None:
    routed = engine({**FULL_SPEC, "routing": {"enabled": True}})
    role = next(child for child in render.children(routed, tenant_keys={}, admin_token="t", cache_salt="s",
                                                   service_monitor=False) if child["kind"] == "Role")
    assert granted(role["rules"]) == GRANTED_TO_ROUTERS <= granted(RULES)
