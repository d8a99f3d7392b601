"""The chart's dashboards and alerts, as real `helm template` renders them with every monitoring
value on (ci/full-values.yaml):

- the PrometheusRule's spec passes `promtool check rules`, and `promtool test rules` runs
  alert_rules_test.yaml, where every alert fires in one group and stays silent in another;
- the dashboard ConfigMap carries Grafana's sidecar label and exactly the dashboard that
  scripts/grafana_dashboard.py writes; the dashboard round-trips through Grafana's dashboard
  schema (grafana-foundation-sdk, which is generated from it) without losing a field, and its
  panels, targets and variables hang together;
- the PodMonitor scrapes the operator's metrics port, keeping the engines' namespace label;
- the ServiceMonitor the operator renders for an engine, whose relabelings give every series the
  `engine` and `component` labels that the dashboard and alerts select by, passes the Prometheus
  Operator's schema (test_packaging_chart checks the chart's PodMonitor and PrometheusRule).

tests/operator/test_operator_chart_queries_prometheus.py runs every query against a real Prometheus.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard

import chart_promql
import grafana_dashboard
import prometheus_operator_schemas
from helm_cli import Helm
from kvpilot.operator import render
from packaging_support import FULL_NAMESPACE, FULL_VALUES
from prometheus_server import fetch_promtool

Manifest = dict[str, Any]
UNIT_TESTS = Path(__file__).with_name("alert_rules_test.yaml")
PROMTOOL_TIMEOUT = 60


@pytest.fixture(scope="module")
def full(helm: Helm) -> list[Manifest]:
    return helm.template("--values", FULL_VALUES, namespace=FULL_NAMESPACE)


def the(manifests: list[Manifest], kind: str) -> Manifest:
    (found,) = [m for m in manifests if m["kind"] == kind]
    return found


@pytest.fixture(scope="module")
def rules_dir(full: list[Manifest], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The rendered PrometheusRule's spec as a Prometheus rule file, beside the unit tests."""
    folder = tmp_path_factory.mktemp("rules")
    (folder / "rules.yaml").write_text(yaml.safe_dump(the(full, "PrometheusRule")["spec"]))
    shutil.copyfile(UNIT_TESTS, folder / UNIT_TESTS.name)
    return folder


def promtool(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(fetch_promtool()), *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=PROMTOOL_TIMEOUT)


def test_the_rules_pass_promtool_check(rules_dir: Path) -> None:
    done = promtool("check", "rules", "rules.yaml", cwd=rules_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(chart_promql.alert_expressions(chart_promql.rules()))} rules found" in done.stdout


def test_each_alert_fires_and_stays_silent_in_promtools_unit_tests(rules_dir: Path) -> None:
    done = promtool("test", "rules", UNIT_TESTS.name, cwd=rules_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    cases = [case for group in yaml.safe_load(UNIT_TESTS.read_text())["tests"] for case in group["alert_rule_test"]]
    for alert in chart_promql.alert_expressions(chart_promql.rules()):
        expected = [case["exp_alerts"] for case in cases if case["alertname"] == alert]
        assert any(expected), f"no unit test where {alert} fires"
        assert [] in expected, f"no unit test where {alert} stays silent"


def test_the_rule_carries_the_rule_files_groups_and_the_values_labels(full: list[Manifest]) -> None:
    rule = the(full, "PrometheusRule")
    assert rule["spec"] == chart_promql.rules()
    assert rule["metadata"]["labels"]["release"] == "monitoring"
    assert rule["metadata"]["namespace"] == FULL_NAMESPACE


def test_the_dashboard_file_is_what_its_script_writes() -> None:
    assert chart_promql.DASHBOARD_FILE.read_text() == grafana_dashboard.render(), "run `make dashboard`"


def test_the_dashboard_configmap_is_found_by_grafanas_sidecar(full: list[Manifest]) -> None:
    config_map = the(full, "ConfigMap")
    meta = config_map["metadata"]
    # The values' label and annotation, and the namespace the sidecar searches.
    assert meta["labels"]["grafana_dashboard"] == "yes"
    assert meta["annotations"] == {"grafana_folder": "LLM serving"}
    assert meta["namespace"] == "monitoring"
    assert json.loads(config_map["data"]["kvpilot.json"]) == chart_promql.dashboard()


def test_the_dashboard_keeps_every_field_through_grafanas_schema() -> None:
    board = chart_promql.dashboard()
    assert _lost_through_the_schema(board) == []
    # A field the schema does not know is lost, and found so.
    board["panels"][1]["fieldconfig"] = board["panels"][1].pop("fieldConfig")
    assert _lost_through_the_schema(board) == ["/panels[1]/fieldconfig"]


def _lost_through_the_schema(board: dict[str, Any]) -> list[str]:
    return _lost(board, json.loads(JSONEncoder().encode(Dashboard.from_json(board))))


def _lost(written: Any, kept: Any, path: str = "") -> list[str]:
    """Where `kept` lacks or changed what `written` had; what the schema adds (its defaults) is fine."""
    if isinstance(written, dict):
        if not isinstance(kept, dict):
            return [path]
        return [lost for key, value in written.items()
                for lost in ([f"{path}/{key}"] if key not in kept else _lost(value, kept[key], f"{path}/{key}"))]
    if isinstance(written, list):
        if not isinstance(kept, list) or len(kept) != len(written):
            return [path]
        return [lost for i, (a, b) in enumerate(zip(written, kept)) for lost in _lost(a, b, f"{path}[{i}]")]
    return [] if written == kept else [path]


def test_every_panel_queries_the_chosen_datasource_with_valid_promql() -> None:
    board = chart_promql.dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    chosen = {"type": "prometheus", "uid": "${datasource}"}
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len(panels) >= 15
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    for panel in panels:
        assert panel["datasource"] == chosen, panel["title"]
        assert panel["targets"], panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == chosen, panel["title"]
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == chosen, variable["name"]
    # Every query parses once Grafana has filled in the variables that the dashboard defines.
    values = {name: ".*" for name in variables}
    for title, expr in chart_promql.panel_queries(board, values, "1m").items():
        assert chart_promql.selectors(expr), title
    for selector, _ in chart_promql.variable_queries(board, values).values():
        promql_parser.parse(selector)


def test_panels_tile_the_grid_without_overlapping() -> None:
    taken: set[tuple[int, int]] = set()
    for panel in chart_promql.dashboard()["panels"]:
        box = panel["gridPos"]
        assert 0 <= box["x"] and box["x"] + box["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(box["x"], box["x"] + box["w"]) for y in range(box["y"], box["y"] + box["h"])}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


def test_the_pod_monitor_scrapes_the_operators_metrics_port(full: list[Manifest]) -> None:
    monitor, deployment = the(full, "PodMonitor"), the(full, "Deployment")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["honorLabels"] is True
    assert endpoint["interval"] == "15s"
    assert monitor["metadata"]["labels"]["release"] == "monitoring"
    pod = deployment["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    (port,) = [p for p in container["ports"] if p["name"] == endpoint["port"]]
    assert f"--metrics-endpoint=http://0.0.0.0:{port['containerPort']}{endpoint['path']}" in container["args"]


def test_the_operators_service_monitor_labels_each_series_by_engine_and_component() -> None:
    engine = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceEngine",
              "metadata": {"name": "qwen", "namespace": "ml", "uid": "6a1c"}, "spec": {"routing": {"enabled": True}}}
    monitor = render.service_monitor_for(engine)
    (endpoint,) = monitor["spec"]["endpoints"]
    assert {r["targetLabel"] for r in endpoint["relabelings"]} == {"engine", "component"}
    broken = {**monitor, "spec": {**monitor["spec"], "endpoints": [{**endpoint, "honorLabels": "yes"}]}}
    found = prometheus_operator_schemas.errors([monitor, broken])
    assert found[0] == []
    assert found[1] and "honorLabels must be boolean" in found[1][0]
