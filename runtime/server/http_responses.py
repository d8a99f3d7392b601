"""`kvpilot:http_responses_total{tenant, code}`: what clients were answered, by the engine's API
server or by a router, counted where every request passes (the admission middleware), and where
a body over the limit is refused ahead of it. The dashboard's 429s per tenant and the error-rate
alert read it.

`tenant` is empty where no tenant is known: no tenants configured, or a request refused before
its key was read (401, 503, a 413 on its declared length). /health, /metrics and the other observation paths are not counted,
so that probes and scrapes do not drown the clients' requests.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from kvpilot.runtime.server.tenants import Tenant


class HttpResponses:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._counter = Counter("kvpilot:http_responses", "HTTP responses to clients, by tenant and status code.",
                                ["tenant", "code"], registry=registry)

    def count(self, status: int, tenant: Tenant | None) -> None:
        self._counter.labels("" if tenant is None else tenant.name, str(status)).inc()
