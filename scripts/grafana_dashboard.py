"""Write the chart's Grafana dashboard (charts/kvpilot/files/dashboards/kvpilot.json) from the
panel list below, so that the JSON has one source and no repeated boilerplate.

Every query selects `namespace=~"$namespace", engine=~"$engine"`: the labels the operator's
ServiceMonitor puts on every engine and router series (render.py), and the operator puts on its
own per-engine gauges (exported_metrics.py). With every engine selected the panels show the
fleet; with one, that engine. `make dashboard` runs this; tests/packaging fails while the file
differs from what it would write, and a test runs every query against a real Prometheus.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DASHBOARD_FILE = REPO / "charts" / "kvpilot" / "files" / "dashboards" / "kvpilot.json"
UID = "kvpilot-fleet"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SELECTED = 'namespace=~"$namespace", engine=~"$engine"'
# Grafana's own window for rate(): at least four scrape intervals, whatever the zoom.
WINDOW = "$__rate_interval"
BY_ENGINE = "namespace, engine"
# Panels are this wide in Grafana's 24-column grid, and this tall.
WIDTH, HEIGHT = 8, 8


def selected(metric: str, extra: str = "") -> str:
    return f"{metric}{{{SELECTED}{', ' + extra if extra else ''}}}"


def rate(metric: str, extra: str = "") -> str:
    return f"rate({selected(metric, extra)}[{WINDOW}])"


def quantile(q: float, histogram: str) -> str:
    return f"histogram_quantile({q}, sum by ({BY_ENGINE}, le) ({rate(histogram + '_bucket')}))"


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: tuple[tuple[str, str], ...]  # (legend, PromQL)
    unit: str = "short"


def latency(title: str, histogram: str, what: str) -> Panel:
    return Panel(title, f"{what}, per engine: the 50th and 99th percentiles of {histogram}.",
                 tuple((f"p{int(q * 100)} {{{{engine}}}}", quantile(q, histogram)) for q in (0.5, 0.99)), "s")


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    ("Traffic and latency", (
        Panel("Requests/s", "Finished requests (choices) per second, per engine and finish reason.",
              (("{{engine}} {{finished_reason}}",
                f"sum by ({BY_ENGINE}, finished_reason) ({rate('vllm:request_success_total')})"),), "reqps"),
        latency("Time to first token", "vllm:time_to_first_token_seconds", "From arrival to the first token"),
        latency("Inter-token latency", "vllm:inter_token_latency_seconds", "Between two tokens of a stream"),
        latency("End-to-end latency", "vllm:e2e_request_latency_seconds", "From arrival to the last token"),
        Panel("Responses by HTTP status", "What clients were answered, by the engines and by the routers in "
              "front of them. 429 is a tenant over its limit; 5xx are errors.",
              (("{{engine}} {{component}} {{code}}",
                f"sum by ({BY_ENGINE}, component, code) ({rate('kvpilot:http_responses_total')})"),), "reqps"),
    )),
    ("KV cache and scheduling", (
        Panel("KV-cache usage", "The share of each pod's KV-cache blocks in use.",
              (("{{engine}} {{pod}}", selected("vllm:kv_cache_usage_perc")),), "percentunit"),
        Panel("Queue depth", "Requests waiting for the engine's scheduler, and those running, per engine.",
              (("waiting {{engine}}", f"sum by ({BY_ENGINE}) ({selected('vllm:num_requests_waiting')})"),
               ("running {{engine}}", f"sum by ({BY_ENGINE}) ({selected('vllm:num_requests_running')})"))),
        Panel("Preemptions/s", "Running requests the scheduler preempted for want of KV-cache blocks (recomputed later).",
              (("{{engine}}", f"sum by ({BY_ENGINE}) ({rate('vllm:num_preemptions_total')})"),)),
        Panel("Prefix-cache hit rate", "Prompt tokens found in the prefix cache over those looked up.",
              (("{{engine}}", f"sum by ({BY_ENGINE}) ({rate('vllm:prefix_cache_hits_total')}) / "
                              f"sum by ({BY_ENGINE}) ({rate('vllm:prefix_cache_queries_total')})"),), "percentunit"),
    )),
    ("Autoscaling and tenants", (
        Panel("Replicas: desired, ready, maximum", "The autoscaler's decision (or spec.replicas without "
              "autoscaling), the engine pods ready, and the most the engine may run.",
              tuple((f"{legend} {{{{engine}}}}", f"max by ({BY_ENGINE}) ({selected(metric)})") for legend, metric in (
                  ("desired", "kvpilot:engine_desired_replicas"), ("ready", "kvpilot:engine_ready_replicas"),
                  ("max", "kvpilot:engine_max_replicas")))),
        Panel("Scheduling policy", "Engine pods on each scheduling policy: with policy auto, the operator "
              "switches them to priority under pressure at maximum replicas.",
              (("{{engine}} {{policy}}",
                f"count by ({BY_ENGINE}, policy) ({selected('kvpilot:scheduling_policy_info')} == 1)"),)),
        Panel("Requests/s per tenant", "Finished requests (choices) per second, per tenant and finish reason.",
              (("{{tenant}} {{finished_reason}}",
                f"sum by (tenant, finished_reason) ({rate('kvpilot:tenant_requests_total')})"),), "reqps"),
        Panel("429s per tenant", "Requests refused because their tenant had maxConcurrentRequests in flight, "
              "by the engines and the routers.",
              (("{{tenant}} {{component}}",
                "sum by (tenant, component) (" + rate("kvpilot:http_responses_total", 'code="429"') + ")"),), "reqps"),
    )),
    ("Router", (
        Panel("Picks/s per replica", "Requests each router sent to each engine replica (first tries).",
              (("{{replica}}", f"sum by ({BY_ENGINE}, replica) ({rate('kvpilot:router_picks_total')})"),), "reqps"),
        Panel("Held requests", "Requests the routers hold while no replica is ready (a scale-up signal), "
              "and those answered 503 after the hold timeout.",
              (("held {{engine}}", f"sum by ({BY_ENGINE}) ({selected('kvpilot:router_requests_held')})"),
               ("timed out/s {{engine}}", f"sum by ({BY_ENGINE}) ({rate('kvpilot:router_hold_timeouts_total')})"))),
        Panel("Retries and resumes/s", "Requests retried on another replica before their first byte, and "
              "streams resumed on another replica after theirs was lost.",
              (("retries {{engine}}", f"sum by ({BY_ENGINE}) ({rate('kvpilot:router_retries_total')})"),
               ("resumes {{engine}}", f"sum by ({BY_ENGINE}) ({rate('kvpilot:router_resumes_total')})"))),
    )),
    ("Operator", (
        Panel("Reconcile passes/s", "The operator's reconcile passes, by result: error when an API call failed.",
              (("{{result}}", f"sum by (result) (rate(kvpilot:operator_reconciles_total[{WINDOW}]))"),)),
        Panel("Since the last successful reconcile", "Time since a reconcile pass last went through (none "
              "since an operator started: no line); passes run on changes, so an idle fleet sees this grow.",
              (("operator {{pod}}",
                "time() - (kvpilot:operator_last_successful_reconcile_timestamp_seconds > 0)"),), "s"),
        Panel("Spec changes not yet reconciled", "Generations of each engine's spec beyond the one its status "
              "reflects: above 0 for long, the operator is not keeping up.",
              (("{{engine}}", f"max by ({BY_ENGINE}) ({selected('kvpilot:engine_generation')} - "
                              f"{selected('kvpilot:engine_observed_generation')})"),)),
    )),
)


def variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name, "label": label, "type": "query", "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"{name}-values"},
        "refresh": 2, "sort": 1, "multi": True, "includeAll": True, "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    }


def panels() -> list[dict[str, Any]]:
    laid_out: list[dict[str, Any]] = []
    y = 0
    for row_title, row_panels in ROWS:
        laid_out.append({"type": "row", "title": row_title, "collapsed": False, "id": len(laid_out) + 1,
                         "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []})
        y += 1
        for index, panel in enumerate(row_panels):
            x = (index % (24 // WIDTH)) * WIDTH
            if index and x == 0:
                y += HEIGHT
            laid_out.append({
                "type": "timeseries", "id": len(laid_out) + 1, "title": panel.title,
                "description": panel.description, "datasource": DATASOURCE,
                "gridPos": {"x": x, "y": y, "w": WIDTH, "h": HEIGHT},
                "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                            "tooltip": {"mode": "multi", "sort": "desc"}},
                "targets": [{"datasource": DATASOURCE, "refId": chr(ord("A") + i), "expr": expr,
                             "legendFormat": legend, "range": True}
                            for i, (legend, expr) in enumerate(panel.targets)],
            })
        y += HEIGHT
    return laid_out


def dashboard() -> dict[str, Any]:
    return {
        "uid": UID, "title": "kvpilot", "tags": ["kvpilot", "vllm", "llm"], "editable": True,
        "schemaVersion": 39, "refresh": "30s", "timezone": "browser", "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"},
        "description": "kvpilot engines, their routers and the operator: every engine selected is the fleet.",
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "refresh": 1},
            variable("namespace", "Namespace", "label_values(vllm:num_requests_running, namespace)"),
            variable("engine", "Engine", 'label_values(vllm:num_requests_running{namespace=~"$namespace"}, engine)'),
        ]},
        "annotations": {"list": []},
        "panels": panels(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main() -> int:
    DASHBOARD_FILE.parent.mkdir(parents=True, exist_ok=True)
    DASHBOARD_FILE.write_text(render())
    print(f"wrote {DASHBOARD_FILE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
