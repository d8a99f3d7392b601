"""The PromQL the chart ships, read from the chart's own files so that no test writes it twice: every
query of the Grafana dashboard (panels and variables, with Grafana's variables filled in) and
every alert's expression; and the metric selectors inside an expression, found by a real PromQL
parser (promql-parser)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import promql_parser
import yaml

CHART = Path(__file__).resolve().parents[1] / "charts" / "kvpilot"
DASHBOARD_FILE = CHART / "files" / "dashboards" / "kvpilot.json"
RULES_FILE = CHART / "files" / "prometheus-rules.yaml"
# label_values(SELECTOR, LABEL): Grafana's Prometheus variable query.
_LABEL_VALUES = re.compile(r"label_values\((?P<selector>.+), *(?P<label>\w+)\)")


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_FILE.read_text())


def rules() -> dict[str, Any]:
    return yaml.safe_load(RULES_FILE.read_text())


def filled(expr: str, variables: dict[str, str], window: str) -> str:
    """`expr` as Grafana sends it: each $variable replaced by its value, $__rate_interval by `window`."""
    expr = expr.replace("$__rate_interval", window)
    for name, value in variables.items():
        expr = expr.replace(f"${name}", value)
    assert "$" not in expr, f"a variable is left in {expr!r}"
    return expr


def panel_queries(board: dict[str, Any], variables: dict[str, str], window: str) -> dict[str, str]:
    """'panel title [refId]' -> its query, filled in."""
    return {f"{panel['title']} [{target['refId']}]": filled(target["expr"], variables, window)
            for panel in board["panels"] if panel["type"] != "row" for target in panel["targets"]}


def variable_queries(board: dict[str, Any], variables: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Each query variable -> (the selector it lists label values of, filled in; the label)."""
    found = {}
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            match = _LABEL_VALUES.fullmatch(variable["query"]["query"])
            assert match, f"variable {variable['name']}: not a label_values(...) query"
            found[variable["name"]] = (filled(match["selector"], variables, "1m"), match["label"])
    return found


def alert_expressions(groups: dict[str, Any]) -> dict[str, str]:
    return {rule["alert"]: rule["expr"] for group in groups["groups"] for rule in group["rules"]}


def selectors(expr: str) -> list[promql_parser.VectorSelector]:
    """The instant-vector selectors in `expr` (those of range selectors too); str() of one is its PromQL."""
    found: list[promql_parser.VectorSelector] = []

    def walk(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)
            return
        for child in ("lhs", "rhs", "expr", "param", "vector_selector"):
            if getattr(node, child, None) is not None:
                walk(getattr(node, child))
        for arg in getattr(node, "args", None) or ():
            walk(arg)

    walk(promql_parser.parse(expr))
    return found


def matched_labels(selector: promql_parser.VectorSelector) -> set[str]:
    """The labels a selector's matchers name (its metric name aside)."""
    return {matcher.name for matcher in selector.matchers.matchers}
