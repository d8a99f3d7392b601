"""The router's Kubernetes backend source: the slice -> endpoints logic directly, and the
list-and-watch loop against kmock's emulated API server."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest

from kubeconfigs import write_kubeconfig
from kvpilot.runtime.router import endpointslices, kube_client
from kvpilot.runtime.router.backends import Endpoint
from kvpilot.runtime.router.endpointslices import merged, slice_endpoints, slice_port, watch_endpoint_slices

NAMESPACE = "ml"
SLICES = "discovery.k8s.io/v1/endpointslices"
SLICES_URL = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"
_versions = itertools.count(1)


def endpoint(address: str, ready: bool | None = True, terminating: bool = False) -> dict[str, Any]:
    conditions: dict[str, Any] = {"terminating": terminating}
    if ready is not None:
        conditions["ready"] = ready
    return {"addresses": [address], "conditions": conditions}


def endpoint_slice(name: str, *endpoints: dict[str, Any], service: str = "qwen",
                   ports: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": name, "namespace": NAMESPACE, "resourceVersion": str(next(_versions)),
                     "labels": {"kubernetes.io/service-name": service}},
        "ports": [{"name": "http", "port": 8000}] if ports is None else ports,
        "endpoints": list(endpoints),
    }


# The pure part.

def test_a_slice_port_is_the_named_one_or_the_only_one() -> None:
    two = endpoint_slice("a", ports=[{"name": "http", "port": 8000}, {"name": "kv", "port": 5557}])
    assert slice_port(two, "kv") == 5557
    assert slice_port(two, "metrics") is None
    assert slice_port(two, None) is None
    assert slice_port(endpoint_slice("a", ports=[{"name": "", "port": 80}]), None) == 80
    assert slice_port(endpoint_slice("a", ports=[]), None) is None


def test_slice_endpoints_read_readiness_as_the_api_defines_it() -> None:
    item = endpoint_slice(
        "a",
        endpoint("10.0.0.1"),
        endpoint("10.0.0.2", ready=None),
        endpoint("10.0.0.3", ready=False, terminating=True),
        endpoint("fd00::4"),
        {"addresses": [], "conditions": {}},
    )
    assert slice_endpoints(item, 8000) == [
        Endpoint("http://10.0.0.1:8000"),
        Endpoint("http://10.0.0.2:8000"),
        Endpoint("http://10.0.0.3:8000", ready=False, terminating=True),
        Endpoint("http://[fd00::4]:8000"),
    ]


def test_merged_counts_an_address_once_and_ready_wins() -> None:
    moving = [Endpoint("http://b:1", ready=False, terminating=True), Endpoint("http://a:1")]
    assert merged([moving, [Endpoint("http://b:1")], []]) == [Endpoint("http://a:1"), Endpoint("http://b:1")]
    assert merged([[Endpoint("http://b:1")], moving]) == [Endpoint("http://a:1"), Endpoint("http://b:1")]


# The watch, against an emulated API server.

class ApiServer(kmock.KubernetesEmulator):
    """kmock's emulator, plus what a real API server does for these calls and kmock does not:
    label selectors on lists and watches, bookmarks, and watches it ends or expires."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.lists: list[kmock.Request] = []
        self.watches: list[kmock.Request] = []
        self.failing_lists = 0
        self.expire_next_watch = False

    async def _serve_list(self, request: kmock.Request) -> Any:
        self.lists.append(request)
        if self.failing_lists:
            self.failing_lists -= 1
            raise kmock.KubernetesError(status=503, reason="ServiceUnavailable", message="injected")
        listing = await super()._serve_list(request)
        listing["items"] = [item for item in listing["items"] if _selected(request, item)]
        return listing

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        self.watches.append(request)
        if self.expire_next_watch:
            # As a real server answers a resourceVersion it no longer keeps history for.
            self.expire_next_watch = False
            yield {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}
            return
        async for event in super()._serve_watch(request):
            if isinstance(event, dict) and event["type"] == "END":
                return
            if isinstance(event, dict) and event["type"] == "BREAK":
                raise RuntimeError("broken by the test")  # kmock ends the stream with an ERROR event
            if not isinstance(event, dict) or event["type"] == "BOOKMARK" or _selected(request, event["object"]):
                yield event

    async def end_watches(self) -> None:
        """End every open watch, as the server does at its timeoutSeconds."""
        await self._to_watches("END")

    async def break_watches(self) -> None:
        """Fail every open watch midway, as an API server that is restarting does."""
        await self._to_watches("BREAK")

    async def _to_watches(self, kind: str) -> None:
        await self._buses[kmock.resource(SLICES)].put({"type": kind, "object": {"metadata": {"namespace": NAMESPACE}}})

    async def bookmark(self, version: str) -> None:
        await self._buses[kmock.resource(SLICES)].put(
            {"type": "BOOKMARK", "object": {"kind": "EndpointSlice",
                                            "metadata": {"namespace": NAMESPACE, "resourceVersion": version}}})


def _selected(request: kmock.Request, item: dict[str, Any]) -> bool:
    wanted = request.params.get("labelSelector")
    if not wanted:
        return True
    key, value = wanted.split("=", 1)
    return (item.get("metadata", {}).get("labels") or {}).get(key) == value


class Fleet:
    """The emulated server, kubectl's side of it, and what the watch published."""

    def __init__(self, server: ApiServer, session: aiohttp.ClientSession) -> None:
        self.server = server
        self.session = session
        self.published: list[list[Endpoint]] = []

    async def create(self, item: dict[str, Any]) -> None:
        await self._send("POST", SLICES_URL, item)

    async def update(self, item: dict[str, Any]) -> None:
        item["metadata"]["resourceVersion"] = str(next(_versions))
        await self._send("PATCH", f"{SLICES_URL}/{item['metadata']['name']}", item)

    async def delete(self, name: str) -> None:
        await self._send("DELETE", f"{SLICES_URL}/{name}")

    async def publishes(self, *expected: Endpoint) -> None:
        await until(lambda: self.published and self.published[-1] == list(expected),
                    f"{list(expected)} published (last: {self.published[-1:]})")

    async def _send(self, method: str, url: str, body: Any = None) -> None:
        async with self.session.request(method, url, json=body) as response:
            assert response.status < 400, await response.text()


async def until(probe: Callable[[], Any], what: str, timeout_s: float = 10) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not probe():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def watching(tmp_path: Path, port_name: str | None = "http", failing_lists: int = 0) -> AsyncIterator[Fleet]:
    """A fleet whose slices a watch follows, logged in from a kubeconfig; the server fails the
    first `failing_lists` lists."""
    server = ApiServer()
    server.failing_lists = failing_lists
    async with server, kmock.Server(server) as http, aiohttp.ClientSession(base_url=str(http.url)) as session:
        server.resources[SLICES] = kmock.ResourceInfo(
            kind="EndpointSlice", namespaced=True, verbs={"list", "watch", "create", "patch", "delete"})
        fleet = Fleet(server, session)
        kubeconfig = write_kubeconfig(tmp_path, str(http.url), namespace=NAMESPACE)
        client = kube_client.KubeClient(kube_client.kubeconfig_login(kubeconfig))
        task = asyncio.create_task(watch_endpoint_slices(client, NAMESPACE, "qwen", port_name, fleet.published.append))
        try:
            yield fleet
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await client.close()


@pytest.mark.asyncio
async def test_slices_created_updated_and_deleted_are_published(tmp_path: Path) -> None:
    async with watching(tmp_path) as fleet:
        await fleet.publishes()
        first = endpoint_slice("qwen-a", endpoint("10.0.0.1"), endpoint("10.0.0.2"))
        await fleet.create(first)
        await fleet.publishes(Endpoint("http://10.0.0.1:8000"), Endpoint("http://10.0.0.2:8000"))

        first["endpoints"] = [endpoint("10.0.0.1", ready=False), endpoint("10.0.0.2", ready=False, terminating=True)]
        await fleet.update(first)
        await fleet.publishes(Endpoint("http://10.0.0.1:8000", ready=False),
                              Endpoint("http://10.0.0.2:8000", ready=False, terminating=True))

        await fleet.delete("qwen-a")
        await fleet.publishes()
        assert len(fleet.server.lists) == 1


@pytest.mark.asyncio
async def test_two_slices_merge_and_another_services_slice_is_ignored(tmp_path: Path) -> None:
    async with watching(tmp_path) as fleet:
        await fleet.create(endpoint_slice("qwen-a", endpoint("10.0.0.1"), endpoint("10.0.0.2", ready=False)))
        await fleet.create(endpoint_slice("other-a", endpoint("10.0.0.9"), service="other"))
        # The controller moving 10.0.0.2 between slices: for a moment, it is in both.
        await fleet.create(endpoint_slice("qwen-b", endpoint("10.0.0.2"), endpoint("10.0.0.3")))
        await fleet.publishes(Endpoint("http://10.0.0.1:8000"), Endpoint("http://10.0.0.2:8000"),
                              Endpoint("http://10.0.0.3:8000"))
        assert all("10.0.0.9" not in e.url for published in fleet.published for e in published)


@pytest.mark.asyncio
async def test_a_slice_without_the_port_is_left_out_with_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with watching(tmp_path, port_name="http") as fleet:
        await fleet.create(endpoint_slice("qwen-a", endpoint("10.0.0.1"), ports=[{"name": "metrics", "port": 9000}]))
        await fleet.create(endpoint_slice("qwen-b", endpoint("10.0.0.2")))
        await fleet.publishes(Endpoint("http://10.0.0.2:8000"))
    assert "EndpointSlice qwen-a of qwen has not a port named http" in caplog.text


@pytest.mark.asyncio
async def test_a_watch_the_server_ends_resumes_from_the_last_bookmark(tmp_path: Path) -> None:
    async with watching(tmp_path) as fleet:
        await fleet.create(endpoint_slice("qwen-a", endpoint("10.0.0.1")))
        await fleet.publishes(Endpoint("http://10.0.0.1:8000"))
        await fleet.server.bookmark("777")
        await fleet.server.end_watches()
        await until(lambda: len(fleet.server.watches) == 2, "a second watch")
        assert fleet.server.watches[0].params["allowWatchBookmarks"] == "true"
        assert fleet.server.watches[1].params["resourceVersion"] == "777"

        await fleet.create(endpoint_slice("qwen-b", endpoint("10.0.0.2")))
        await fleet.publishes(Endpoint("http://10.0.0.1:8000"), Endpoint("http://10.0.0.2:8000"))
        assert len(fleet.server.lists) == 1


@pytest.mark.asyncio
async def test_an_expired_watch_lists_again(tmp_path: Path) -> None:
    async with watching(tmp_path) as fleet:
        await fleet.create(endpoint_slice("qwen-a", endpoint("10.0.0.1")))
        await fleet.publishes(Endpoint("http://10.0.0.1:8000"))
        fleet.server.expire_next_watch = True
        await fleet.server.end_watches()
        await until(lambda: len(fleet.server.lists) == 2, "a second list")

        await fleet.create(endpoint_slice("qwen-b", endpoint("10.0.0.2")))
        await fleet.publishes(Endpoint("http://10.0.0.1:8000"), Endpoint("http://10.0.0.2:8000"))


@pytest.mark.asyncio
async def test_a_broken_watch_lists_again(tmp_path: Path) -> None:
    async with watching(tmp_path) as fleet:
        await fleet.create(endpoint_slice("qwen-a", endpoint("10.0.0.1")))
        await fleet.publishes(Endpoint("http://10.0.0.1:8000"))
        await fleet.server.break_watches()
        await until(lambda: len(fleet.server.lists) == 2, "a second list")

        await fleet.delete("qwen-a")
        await fleet.publishes()


@pytest.mark.asyncio
async def test_failures_are_retried_and_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=endpointslices.__name__)
    async with watching(tmp_path, failing_lists=2) as fleet:
        await fleet.publishes()
        assert len(fleet.server.lists) == 3
    failures = [r for r in caplog.records if r.name == endpointslices.__name__ and "failed" in r.message]
    assert len(failures) == 1
    assert "works again" in caplog.text
