"""The router's replicas in Kubernetes: the EndpointSlices of the engines' Service, listed and watched.

The EndpointSlice controller keeps them current as pods come, turn ready, shut down and go, so
they say the same as the Service's own routing does, without the router reading pods.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from kvpilot.runtime.router.backends import Endpoint
from kvpilot.runtime.router.kube_client import ApiError, KubeClient, Login, default_login

logger = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
# The server ends each watch after this long, and the watch resumes from where it was.
WATCH_TIMEOUT_S = 300
# Waits before retrying after a failure; the last one repeats while it lasts.
RETRY_DELAYS_S = (0.1, 0.5, 2.0, 10.0, 30.0)
_GONE = 410

EndpointSlice = Mapping[str, Any]


def slice_port(endpoint_slice: EndpointSlice, port_name: str | None) -> int | None:
    """The slice's port named `port_name`, or its only port where no name is given."""
    ports = endpoint_slice.get("ports") or []
    if port_name is None:
        return ports[0].get("port") if len(ports) == 1 else None
    return next((port.get("port") for port in ports if port.get("name") == port_name), None)


def slice_endpoints(endpoint_slice: EndpointSlice, port: int) -> list[Endpoint]:
    endpoints = []
    for endpoint in endpoint_slice.get("endpoints") or []:
        addresses = endpoint.get("addresses") or []
        if not addresses:
            continue
        # The addresses of one endpoint are interchangeable; the API lets a client use the first.
        address = addresses[0]
        host = f"[{address}]" if ":" in address else address
        conditions = endpoint.get("conditions") or {}
        endpoints.append(Endpoint(
            url=f"http://{host}:{port}",
            # An unknown readiness counts as ready, as the API defines it.
            ready=conditions.get("ready") is not False,
            terminating=conditions.get("terminating") is True,
        ))
    return endpoints


def merged(per_slice: Iterable[list[Endpoint]]) -> list[Endpoint]:
    """One endpoint per url, sorted by url. An address in two slices (the controller moves
    endpoints between slices) counts once, as ready if either slice says so."""
    best: dict[str, Endpoint] = {}
    for endpoints in per_slice:
        for endpoint in endpoints:
            seen = best.get(endpoint.url)
            if seen is None or _rank(endpoint) > _rank(seen):
                best[endpoint.url] = endpoint
    return [best[url] for url in sorted(best)]


def _rank(endpoint: Endpoint) -> tuple[bool, bool]:
    return endpoint.ready, not endpoint.terminating


async def watch_endpoint_slices(
    client: KubeClient,
    namespace: str,
    service: str,
    port_name: str | None,
    publish: Callable[[list[Endpoint]], None],
) -> None:
    """Publish the Service's endpoints, and again each time they change, forever. Failures are
    logged (once until they change) and retried; only cancellation ends it."""
    slices = _Slices(service, port_name, publish)
    path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
    selector = f"{SERVICE_NAME_LABEL}={service}"
    failures = _FailureLog(service)
    retries = 0
    while True:
        try:
            listing = await client.list(path, label_selector=selector)
            slices.replace(listing.get("items") or [])
            failures.recovered()
            retries = 0
            version = listing["metadata"]["resourceVersion"]
            while True:
                async for event in client.watch(path, label_selector=selector, resource_version=version,
                                                timeout_s=WATCH_TIMEOUT_S):
                    version = event["object"]["metadata"]["resourceVersion"]
                    slices.apply(event)
        except ApiError as error:
            if error.status == _GONE:
                logger.info("The watch of %s's EndpointSlices expired; listing them again", service)
                continue
            failures.failed(str(error.status or "no answer"), error)
        except Exception as error:  # noqa: BLE001 - the router keeps its last endpoints and retries
            failures.failed(type(error).__name__, error)
        await asyncio.sleep(RETRY_DELAYS_S[min(retries, len(RETRY_DELAYS_S) - 1)])
        retries += 1


class _Slices:
    """The endpoints of each slice by name, published merged whenever the merge changes."""

    def __init__(self, service: str, port_name: str | None, publish: Callable[[list[Endpoint]], None]) -> None:
        self._service = service
        self._port_name = port_name
        self._publish = publish
        self._endpoints: dict[str, list[Endpoint]] = {}
        self._published: list[Endpoint] | None = None

    def replace(self, items: Iterable[EndpointSlice]) -> None:
        self._endpoints = {item["metadata"]["name"]: self._endpoints_of(item) for item in items}
        self._publish_changes()

    def apply(self, event: Mapping[str, Any]) -> None:
        """An ADDED, MODIFIED or DELETED event; a BOOKMARK only moves the watch's version on."""
        kind, item = event["type"], event["object"]
        if kind in ("ADDED", "MODIFIED"):
            self._endpoints[item["metadata"]["name"]] = self._endpoints_of(item)
        elif kind == "DELETED":
            self._endpoints.pop(item["metadata"]["name"], None)
        self._publish_changes()

    def _endpoints_of(self, item: EndpointSlice) -> list[Endpoint]:
        port = slice_port(item, self._port_name)
        if port is None:
            wanted = f"a port named {self._port_name}" if self._port_name else "exactly one port"
            logger.warning("EndpointSlice %s of %s has not %s; its endpoints are left out",
                           item["metadata"]["name"], self._service, wanted)
            return []
        return slice_endpoints(item, port)

    def _publish_changes(self) -> None:
        endpoints = merged(self._endpoints.values())
        if endpoints != self._published:
            self._publish(endpoints)
            self._published = endpoints


class _FailureLog:
    """Logs a failure when it first happens or changes kind, not on every retry of it."""

    def __init__(self, service: str) -> None:
        self._service = service
        self._kind: str | None = None

    def failed(self, kind: str, error: Exception) -> None:
        if kind != self._kind:
            self._kind = kind
            logger.warning("Reading %s's EndpointSlices failed (%s); retrying until it works", self._service, error)

    def recovered(self) -> None:
        if self._kind is not None:
            self._kind = None
            logger.info("Reading %s's EndpointSlices works again", self._service)


def endpoint_slices_source(service: str, namespace: str | None, port_name: str | None, login: Login | None = None
                           ) -> Callable[[Callable[[list[Endpoint]], None]], Awaitable[None]]:
    """A backend source (app.py) following `service`'s EndpointSlices in `namespace` (default: the
    login's own, the pod's namespace in a cluster)."""

    async def source(publish: Callable[[list[Endpoint]], None]) -> None:
        client = KubeClient(login or default_login())
        try:
            await watch_endpoint_slices(client, namespace or client.login.namespace, service, port_name, publish)
        finally:
            await client.close()

    return source
