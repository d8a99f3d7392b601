"""Every PromQL expression the chart ships (the dashboard's panels and variables, the alerts' rules;
read from the chart's files by chart_promql) against a real Prometheus that scrapes a real fleet
under a short load: the kopf operator against the emulated API server, and a real `kvpilot serve`
and `kvpilot router` started on what the operator rendered (kubelet.py).

Prometheus scrapes them as the Prometheus Operator would: the engine and the router with the
relabelings of the ServiceMonitor the operator applied, from their pods' rendered labels; the
operator as the chart's PodMonitor does (honorLabels). Each panel query must return data, each
variable must list the engine, and each alert's expression must run and stay silent on this
healthy fleet, and every selector in it find data (or, for a value a healthy fleet never shows,
such as a 5xx code, its metric with every label the selector names).

With KVPILOT_DASHBOARD_FIGURE=PATH, the load lasts a minute and the panels' data over it is drawn
into PATH (the README's picture of the dashboard).
"""

from __future__ import annotations

import asyncio
import copy
import math
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

import chart_promql
from kubelet import Kubelet
from operator_harness import CHILDREN, NAMESPACE, SPEC, Cluster, cluster, created, eventually, free_port, operator
from prometheus_server import PrometheusServer, Target, fetch_prometheus, scrape_config, scrape_job
from server_harness import HTTP_TIMEOUT_S  # on sys.path once kubelet is imported

pytestmark = pytest.mark.timeout(400)

TENANT_LIMIT = 2
ENGINE = {
    **copy.deepcopy(SPEC), "replicas": 1,
    "scheduling": {"tenants": [{"name": "prod", "priority": 10, "apiKeySecretRef": {"name": "prod-key"},
                                "maxConcurrentRequests": TENANT_LIMIT}]},
    "routing": {"enabled": True},
}
AUTH = {"Authorization": "Bearer sk-prod"}
# Short, so that the test is quick: a scrape every second, rates over 15 s (a dashboard's
# $__rate_interval is at least four scrapes).
SCRAPE_INTERVAL = "1s"
RATE_WINDOW = "15s"
FIGURE = os.environ.get("KVPILOT_DASHBOARD_FIGURE")
LOAD_SECONDS = 60.0 if FIGURE else 10.0
# More clients than the tenant may run at once: some get 429.
CLIENTS = 2 * TENANT_LIMIT + 2
SELECTED = {"namespace": NAMESPACE, "engine": "qwen"}


async def load(router: str) -> dict[int, int]:
    """CLIENTS clients, each asking again as soon as it is answered, for LOAD_SECONDS; the answers
    counted by status."""
    statuses: dict[int, int] = {}
    stop = time.monotonic() + LOAD_SECONDS
    async with httpx.AsyncClient(base_url=router, timeout=HTTP_TIMEOUT_S, headers=AUTH) as client:
        async def one_after_another(i: int) -> None:
            while time.monotonic() < stop:
                response = await client.post("/v1/completions", json={
                    "model": "tiny", "prompt": f"Client {i} asks about the library", "max_tokens": 16,
                    "ignore_eos": True})
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                if response.status_code == 429:
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(one_after_another(i) for i in range(CLIENTS)))
    return statuses


def pod_labels(k: Cluster, deployment: str) -> tuple[tuple[str, str], ...]:
    found = k.deployment(deployment)
    assert found is not None, f"Deployment {deployment} was not rendered"
    return tuple(found["spec"]["template"]["metadata"]["labels"].items())


async def query(client: httpx.AsyncClient, expr: str, at: float) -> list[dict[str, Any]] | str:
    """The instant vector `expr` gives at `at`, or what Prometheus said was wrong with it."""
    response = await client.post("/api/v1/query", data={"query": expr, "time": str(at)})
    answer = response.json()
    if answer.get("status") != "success":
        return f"{answer.get('errorType')}: {answer.get('error')}"
    return answer["data"]["result"]


async def scraped(url: str, expr: str, value: float) -> bool:
    """Whether Prometheus's latest value of the one-series `expr` is `value`."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        result = await query(client, expr, time.time())
    return bool(result) and not isinstance(result, str) and float(result[0]["value"][1]) == value


def finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(sample["value"][1])) for sample in result)


def test_every_dashboard_and_alert_query_finds_the_fleets_data(tiny_llama_dir: Path, tmp_path: Path) -> None:
    metrics_port = free_port()

    async def scenario() -> None:
        async with cluster(tmp_path, service_monitors=True) as k:
            kubelet = Kubelet(k, tiny_llama_dir, tmp_path)
            async with operator(metrics_endpoint=f"http://127.0.0.1:{metrics_port}/metrics"):
                await created(k, ENGINE)
                monitor = await eventually(lambda: k.object(CHILDREN["ServiceMonitor"], "qwen"), "the ServiceMonitor")
                await eventually(lambda: k.object("v1/secrets", "qwen-cache-salt"), "the salt Secret")
                await kubelet.start_router(hold_timeout=60)
                kubelet_task = asyncio.create_task(kubelet.run())
                prometheus = None
                try:
                    await eventually(lambda: kubelet.engine, "the engine", timeout=120)
                    (endpoint,) = monitor["spec"]["endpoints"]
                    fleet = [Target(kubelet.engine.base_url.removeprefix("http://"), NAMESPACE, "qwen-0",
                                    "qwen-engines", pod_labels(k, "qwen")),
                             Target(kubelet.router.base_url.removeprefix("http://"), NAMESPACE, "qwen-router-a",
                                    "qwen", pod_labels(k, "qwen-router"))]
                    the_operator = Target(f"127.0.0.1:{metrics_port}", "kvpilot-system", "kvpilot-operator-0", "")
                    config = scrape_config([
                        scrape_job("kvpilot", fleet, SCRAPE_INTERVAL, relabelings=endpoint["relabelings"]),
                        scrape_job("kvpilot-operator", [the_operator], SCRAPE_INTERVAL, honor_labels=True),
                    ], SCRAPE_INTERVAL)
                    workdir = tmp_path / "prometheus"
                    workdir.mkdir()
                    prometheus = await asyncio.to_thread(PrometheusServer, fetch_prometheus(), workdir, config)
                    started = time.time()
                    statuses = await load(kubelet.router.base_url)
                    assert set(statuses) == {200, 429} and statuses[200] > CLIENTS, statuses
                    # Once Prometheus has scraped the last answer, the router's count is the clients'.
                    answered = 'sum(kvpilot:http_responses_total{component="router"})'
                    await eventually(lambda: scraped(prometheus.url, answered, sum(statuses.values())),
                                     "Prometheus to scrape every answer the clients got")
                    # The engine is scraped on its own clock: on a slow machine its last scrape could
                    # still show the load's queue, which the queue alert reads.
                    await eventually(lambda: scraped(prometheus.url, "sum(vllm:num_requests_waiting)", 0),
                                     "Prometheus to see the engine's queue empty")
                    await check_queries(prometheus.url, time.time())
                    if FIGURE:
                        await draw(prometheus.url, started, time.time(), Path(FIGURE))
                finally:
                    kubelet_task.cancel()
                    for server in (prometheus, kubelet.engine, kubelet.router):
                        if server is not None:
                            await asyncio.to_thread(server.stop)

    asyncio.run(asyncio.wait_for(scenario(), 280 + LOAD_SECONDS))


async def check_queries(url: str, at: float) -> None:
    board = chart_promql.dashboard()
    missing: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        for title, expr in chart_promql.panel_queries(board, SELECTED, RATE_WINDOW).items():
            result = await query(client, expr, at)
            if isinstance(result, str) or not finite(result):
                missing.append(f"panel {title}: {expr} -> {result or 'no data'}")
        for name, (selector, label) in chart_promql.variable_queries(board, SELECTED).items():
            result = await query(client, f"group by ({label}) ({selector})", at)
            if isinstance(result, str) or SELECTED[name] not in {s["metric"].get(label) for s in result}:
                missing.append(f"variable {name}: {selector} does not list {SELECTED[name]!r}: {result}")
        for alert, expr in chart_promql.alert_expressions(chart_promql.rules()).items():
            result = await query(client, expr, at)
            if result:  # an error, or the alert firing
                missing.append(f"alert {alert} on a healthy fleet: {result}")
            for selector in chart_promql.selectors(expr):
                if not await query(client, str(selector), at):
                    # Some values must not occur on a healthy fleet (a 5xx): the metric must still
                    # be there, with every label the selector names.
                    series = await query(client, selector.name, at)
                    shown = set().union(*(s["metric"] for s in series)) if isinstance(series, list) else set()
                    if not series or not chart_promql.matched_labels(selector) <= shown:
                        missing.append(f"alert {alert}: no data for {selector}, nor {selector.name} with "
                                       f"labels {sorted(chart_promql.matched_labels(selector))}")
    assert missing == [], "\n".join(missing)


async def draw(url: str, start: float, end: float, path: Path) -> None:
    """Each panel's queries over [start, end], one small plot per panel, in the dashboard's order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    board = chart_promql.dashboard()
    panels = [p for p in board["panels"] if p["type"] != "row"]
    columns = 4
    figure, axes = plt.subplots(math.ceil(len(panels) / columns), columns,
                                figsize=(4.2 * columns, 2.6 * math.ceil(len(panels) / columns)))
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        for ax, panel in zip(axes.flat, panels):
            for target in panel["targets"]:
                expr = chart_promql.filled(target["expr"], SELECTED, RATE_WINDOW)
                answer = (await client.post("/api/v1/query_range", data={
                    "query": expr, "start": str(start), "end": str(end), "step": "1"})).json()
                for series in answer["data"]["result"]:
                    times = [float(t) - start for t, _ in series["values"]]
                    legend = target["legendFormat"]
                    for label, value in series["metric"].items():
                        legend = legend.replace(f"{{{{{label}}}}}", value)
                    ax.plot(times, [float(v) for _, v in series["values"]], label=legend.strip())
            ax.set_title(panel["title"], fontsize=9)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=6, loc="upper left")
        for ax in axes.flat[len(panels):]:
            ax.axis("off")
    figure.suptitle(f"kvpilot dashboard: one engine and its router under {LOAD_SECONDS:.0f} s of load "
                    "(seconds since the load began)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)
