"""ServiceMonitors are children like the others where their CRD is served: one deleted or edited
by hand is put back at once, by its own event (nothing else here would start a pass of its engine). Where the CRD is missing, the operator
neither makes nor watches them, and runs as well as ever."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from kvpilot.operator import kube
from operator_harness import CHILDREN, SPEC, Cluster, child, cluster, created, eventually, operator, run

pytestmark = pytest.mark.timeout(90)


async def first_pass_done(k: Cluster) -> dict[str, Any]:
    """The ServiceMonitor of an engine whose one pass has ended. No keyed tenant: its Secret's
    event would start a second pass, which would put back whatever the test changes."""
    await k.create_engine("qwen", {**SPEC, "scheduling": {}})
    monitor = await eventually(lambda: child(k, "ServiceMonitor"), "the ServiceMonitor, the last child")
    await eventually(lambda: k.engine("qwen").get("status"), "the pass's status")
    return monitor


def test_a_deleted_service_monitor_is_recreated_at_once(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, service_monitors=True) as k, operator():
            first = await first_pass_done(k)
            await k.delete(kube.path_of(first))
            again = await eventually(
                lambda: (c := child(k, "ServiceMonitor")) and c["metadata"]["uid"] != first["metadata"]["uid"] and c,
                "a new ServiceMonitor")
            assert again["spec"] == first["spec"]

    run(scenario())


def test_a_service_monitor_edited_by_hand_is_put_back(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, service_monitors=True) as k, operator():
            first = await first_pass_done(k)
            # Scraped once a minute instead, by hand: a quarter of the autoscaler's samples.
            await k.patch(kube.path_of(first), {"spec": {"endpoints": [{"port": "http", "interval": "60s"}]}})
            await eventually(lambda: child(k, "ServiceMonitor")["spec"] == first["spec"], "the rendered spec again")

    run(scenario())


def test_without_their_crd_nothing_watches_or_makes_service_monitors(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, operator():
            await created(k)
            service = await eventually(lambda: child(k, "Service"), "the Service")
            # The other children are followed as ever: a deleted Service comes back.
            await k.delete(kube.path_of(service))
            await eventually(lambda: (c := child(k, "Service")) and c["metadata"]["uid"] != service["metadata"]["uid"],
                             "a new Service")
            assert not [key for key in k.server.objects if key[0] == CHILDREN["ServiceMonitor"]]
            assert not [r for r in k.server if r.resource is not None and r.resource.plural == "servicemonitors"]

    with caplog.at_level(logging.WARNING):
        run(scenario())
    problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert problems == []
    # kopf's one word that the CRD is missing, at startup.
    assert [r for r in caplog.records if "servicemonitors" in r.getMessage()
            and r.levelno == logging.WARNING and "Unresolved resources" in r.getMessage()]
