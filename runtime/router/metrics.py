"""The router's Prometheus metrics, under `kvpilot:router_`: held requests (what the operator scales
from zero on), and per replica its picks, requests in flight, predicted prefix hits, retries and
resumes. Per-replica gauges are read from the fleet at each scrape, so a replica gone is gone
from the page too.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvpilot.runtime.router.picking import ReplicaState
from kvpilot.runtime.router.replicas import Fleet
from kvpilot.runtime.server.http_responses import HttpResponses


class RouterMetrics:
    def __init__(self, fleet: Fleet, held_count: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        Gauge("kvpilot:router_requests_held", "requests waiting for a ready replica",
              registry=self.registry).set_function(held_count)
        self.picks = Counter("kvpilot:router_picks", "requests sent to each replica (first tries)", ["replica"],
                             registry=self.registry)
        self.predicted_hit_blocks = Counter(
            "kvpilot:router_prefix_hit_blocks_predicted",
            "leading prompt blocks the picked replica held when picked, by its KV-cache events", ["replica"],
            registry=self.registry)
        self.retries = Counter("kvpilot:router_retries", "requests that failed on a replica before their first "
                               "byte, or streams lost mid-way", ["replica"], registry=self.registry)
        self.resumes = Counter("kvpilot:router_resumes", "streams resumed on this replica after another was lost",
                               ["replica"], registry=self.registry)
        self.hold_timeouts = Counter("kvpilot:router_hold_timeouts", "held requests answered 503 after "
                                     "--hold-timeout", registry=self.registry)
        self.slow_clients = Counter("kvpilot:router_slow_clients", "streams ended because their client stopped "
                                    "reading", registry=self.registry)
        self.http_responses = HttpResponses(self.registry)
        self.registry.register(_FleetCollector(fleet))

    def picked(self, state: ReplicaState) -> None:
        self.picks.labels(state.name).inc()
        # A replica's retries and resumes are shown from its first pick, at 0 until they happen.
        self.retries.labels(state.name)
        self.resumes.labels(state.name)
        if state.prefix_blocks:
            self.predicted_hit_blocks.labels(state.name).inc(state.prefix_blocks)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _FleetCollector(Collector):
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self):
        in_flight = GaugeMetricFamily("kvpilot:router_requests_in_flight",
                                      "requests this router sent to each replica that have not finished", labels=["replica"])
        ready = GaugeMetricFamily("kvpilot:router_replica_ready", "1 while the replica takes requests", labels=["replica"])
        synced = GaugeMetricFamily("kvpilot:router_kv_events_synced",
                                   "1 while the replica's KV-cache index is in step with its events", labels=["replica"])
        engine_hits = GaugeMetricFamily(
            "kvpilot:router_engine_prefix_cache_hits",
            "the replica's own vllm:prefix_cache_hits_total (tokens) at the router's last reading, beside "
            "kvpilot:router_prefix_hit_blocks_predicted_total", labels=["replica"])
        for replica in self.fleet.replicas.values():
            in_flight.add_metric([replica.url], replica.in_flight)
            ready.add_metric([replica.url], int(replica.ready))
            synced.add_metric([replica.url], int(replica.block_size is not None))
            if replica.prefix_cache_hits is not None:
                engine_hits.add_metric([replica.url], replica.prefix_cache_hits)
        return [in_flight, ready, synced, engine_hits]
