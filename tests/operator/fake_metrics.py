"""Test-driven metrics endpoints for the operator's control loop: each fake pod's /metrics page
(rendered by the engine's own metrics code), and a fake Prometheus HTTP API answering
/api/v1/query from the same readings. A test sets the readings, or breaks either endpoint."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from aiohttp import web

from kvpilot.runtime.router.metrics import RouterMetrics
from kvpilot.runtime.server.metrics import ServerMetrics

SLOW_SECONDS = 2.0


@dataclass
class Gauges:
    kv: float = 0.0
    waiting: int = 0
    running: int = 0
    finished: int = 0  # vllm:request_success_total
    scraped_at: float | None = None  # what Prometheus reports as the last scrape; None: now


@dataclass
class FakeMetrics:
    url: str = ""
    pods: dict[str, Gauges] = field(default_factory=dict)
    # Router pods: the requests each holds (kvpilot:router_requests_held).
    held: dict[str, int] = field(default_factory=dict)
    # A page that replaces a pod's rendered one (not Prometheus text, NaN, ...).
    raw_pages: dict[str, str] = field(default_factory=dict)
    down: bool = False  # every endpoint answers 503
    slow: set[str] = field(default_factory=set)  # pods whose page answers only after SLOW_SECONDS
    authorizations: list[str] = field(default_factory=list)
    queries: list[str] = field(default_factory=list)

    def set(self, pods: Mapping[str, Any], **gauges: Any) -> None:
        for pod in pods:
            self.pods[pod] = Gauges(**gauges)

    def pod_url(self, pod: Mapping[str, Any]) -> str:
        return f"{self.url}/pods/{pod['metadata']['name']}/metrics"

    async def _page(self, request: web.Request) -> web.Response:
        pod = request.match_info["pod"]
        if self.down:
            return web.Response(status=503, text="unavailable")
        if pod in self.slow:
            await asyncio.sleep(SLOW_SECONDS)
        if pod in self.raw_pages:
            return web.Response(text=self.raw_pages[pod])
        if pod in self.held:
            return web.Response(text=_router_page(self.held[pod]), content_type="text/plain")
        if pod not in self.pods:
            return web.Response(status=404, text="no such pod")
        gauges = self.pods[pod]
        text = _engine_page(gauges.kv, gauges.waiting, gauges.running, gauges.finished)
        return web.Response(text=text, content_type="text/plain")

    async def _query(self, request: web.Request) -> web.Response:
        self.authorizations.append(request.headers.get("Authorization", ""))
        if self.down:
            return web.json_response({"status": "error", "errorType": "unavailable", "error": "down"}, status=503)
        query = (await request.post())["query"]
        self.queries.append(query)
        asked = re.search(r'pod=~"([^"]*)"', query)
        assert asked is not None, query
        wanted = asked.group(1).replace("\\\\", "\\").split("|")
        pods = [pod for pod in self.pods if re.escape(pod) in wanted]
        if query.startswith("max by (pod) (kvpilot:router_requests_held{"):
            values = {pod: count for pod, count in self.held.items() if re.escape(pod) in wanted}
        elif query.startswith("max by (pod) (timestamp("):
            values = {pod: self.pods[pod].scraped_at or time.time() for pod in pods}
        elif query.startswith("sum by (pod, le) ("):
            values = {}  # latency histograms: this Prometheus has none, as one without the engines' buckets
        elif query.startswith("sum by (pod) (vllm:request_success_total{"):
            values = {pod: self.pods[pod].finished for pod in pods}
        else:
            name = re.search(r"avg_over_time\(([a-z_:]+)\{", query).group(1)
            field_of = {"vllm:kv_cache_usage_perc": "kv", "vllm:num_requests_waiting": "waiting",
                        "vllm:num_requests_running": "running"}[name]
            values = {pod: getattr(self.pods[pod], field_of) for pod in pods}
        return web.json_response({"status": "success", "data": {"resultType": "vector", "result": [
            {"metric": {"pod": pod}, "value": [time.time(), str(value)]} for pod, value in values.items()]}})


# Rendering the engine's whole page (some 300 samples) costs milliseconds of CPU, and the fake
# pods answer on the operator's own event loop, within its read timeout (a third of the tests'
# 1 s interval): on a loaded machine, rendering per request timed reads out. Once per reading.
@functools.lru_cache(maxsize=64)
def _engine_page(kv: float, waiting: int, running: int, finished: int) -> str:
    page = ServerMetrics("qwen", 16, 100)
    page.kv_cache_usage.set(kv)
    page.num_requests_waiting.set(waiting)
    page.num_requests_running.set(running)
    # The engine's page counts finished requests per reason from 0; these all stopped.
    return re.sub(r'^(vllm:request_success_total\{[^}]*finished_reason="stop"[^}]*\}) 0\.0$',
                  rf"\g<1> {finished}.0", page.render().decode(), flags=re.MULTILINE)


def _router_page(held: int) -> str:
    # The router's own renderer, with no replica known (its per-replica gauges are not read here).
    return RouterMetrics(SimpleNamespace(replicas={}), lambda: held).render().decode()  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def fake_metrics() -> AsyncIterator[FakeMetrics]:
    fake = FakeMetrics()
    app = web.Application()
    app.router.add_get("/pods/{pod}/metrics", fake._page)
    app.router.add_post("/api/v1/query", fake._query)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    fake.url = f"http://127.0.0.1:{port}"
    try:
        yield fake
    finally:
        await runner.cleanup()
