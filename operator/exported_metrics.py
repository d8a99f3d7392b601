"""What the operator itself tells Prometheus, for the chart's dashboard and alerts.

- Per engine (labels `namespace`, `engine`): the replicas the autoscaler wants, those that exist
  and those ready, the most it may run, and the spec's generation beside the one status reflects.
  They are read from the engines' watch events (`observe`), so they follow status whoever writes
  it, and a deleted engine's series go at once (`forget`).
- Per operator: its reconcile passes by result, and when the last one went through.
- Per operator replica: whether it leads (`kvpilot:operator_leader`). A standby serves that
  gauge alone, at 0 (`standby_page`), so that its target is up and "no replica leads" can alert.

An engine without autoscaling cannot go past its spec.replicas, so that is its maximum here: "at
its maximum" then means "cannot add a replica", which is what the alerts ask.

The operator scrapes as a target of its own, so the series carry the operator pod's target
labels too; the chart's PodMonitor keeps the engine's `namespace` label (honorLabels).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
RESULTS = ("success", "error")


def engine_values(engine: Mapping[str, Any]) -> dict[str, float]:
    """The per-engine gauges' values, by metric name, from an InferenceEngine as the API serves it."""
    spec, status = engine["spec"], engine.get("status") or {}
    autoscaling = spec.get("autoscaling") or {}
    generation = engine["metadata"].get("generation", 0)
    return {
        "kvpilot:engine_desired_replicas": status.get("desiredReplicas", spec["replicas"]),
        "kvpilot:engine_replicas": status.get("replicas", 0),
        "kvpilot:engine_ready_replicas": status.get("readyReplicas", 0),
        "kvpilot:engine_max_replicas": autoscaling["maxReplicas"] if autoscaling.get("enabled") else spec["replicas"],
        "kvpilot:engine_generation": generation,
        # Before the first pass wrote status, nothing of the spec is reconciled yet.
        "kvpilot:engine_observed_generation": status.get("observedGeneration", 0),
    }


_ENGINE_HELP = {
    "kvpilot:engine_desired_replicas": "Replicas the engine should run: the autoscaler's last decision, else spec.replicas.",
    "kvpilot:engine_replicas": "Engine pods that exist (status.replicas).",
    "kvpilot:engine_ready_replicas": "Engine pods that are ready (status.readyReplicas).",
    "kvpilot:engine_max_replicas": "The most replicas the engine may run: autoscaling.maxReplicas, else spec.replicas.",
    "kvpilot:engine_generation": "The engine's metadata.generation: each spec change raises it.",
    "kvpilot:engine_observed_generation": "The generation the engine's status reflects (status.observedGeneration).",
}


class OperatorMetrics:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.registry = CollectorRegistry()
        self._clock = clock
        self._engine_gauges = {name: Gauge(name, doc, ["namespace", "engine"], registry=self.registry)
                               for name, doc in _ENGINE_HELP.items()}
        self._passes = Counter("kvpilot:operator_reconciles", "Reconcile passes, by result: error when an API "
                               "call failed (the pass is retried with backoff).", ["result"], registry=self.registry)
        for result in RESULTS:
            self._passes.labels(result)
        self._last_success = Gauge("kvpilot:operator_last_successful_reconcile_timestamp_seconds",
                                   "When a reconcile pass last went through (0: none since the operator started).",
                                   registry=self.registry)
        # Only the replica that leads (or runs alone) reconciles, and so builds these metrics.
        _leader_gauge(self.registry).set(1)

    def observe(self, engine: Mapping[str, Any]) -> None:
        labels = engine["metadata"]["namespace"], engine["metadata"]["name"]
        for name, value in engine_values(engine).items():
            self._engine_gauges[name].labels(*labels).set(value)

    def forget(self, namespace: str, name: str) -> None:
        for gauge in self._engine_gauges.values():
            with contextlib.suppress(KeyError):
                gauge.remove(namespace, name)

    def reconciled(self, ok: bool) -> None:
        self._passes.labels("success" if ok else "error").inc()
        if ok:
            self._last_success.set(self._clock())

    def render(self) -> bytes:
        return generate_latest(self.registry)


def standby_page() -> bytes:
    """What a standby replica serves: it reconciles nothing, so it says only that it does not lead."""
    registry = CollectorRegistry()
    _leader_gauge(registry).set(0)
    return generate_latest(registry)


def _leader_gauge(registry: CollectorRegistry) -> Gauge:
    return Gauge("kvpilot:operator_leader", "1 in the operator replica that holds the Lease (or runs alone), "
                 "0 in a standby.", registry=registry)


async def serve(endpoint: str, render: Callable[[], bytes]) -> web.AppRunner:
    """Serve the page `render` makes at `endpoint` (http://HOST:PORT/PATH, as the liveness endpoint
    is given); the caller cleans up the runner when the operator stops."""
    address = urlsplit(endpoint)  # checked by `kvpilot operator`'s parser

    async def page(_: web.Request) -> web.Response:
        return web.Response(body=render(), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application()
    app.router.add_get(address.path or "/metrics", page)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, address.hostname, address.port).start()
    return runner
