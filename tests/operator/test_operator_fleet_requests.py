"""What a fleet costs the API server, counted request by request (never timed): a pass that
changes nothing, and one interval of the control loops, each per engine and across the fleet.

The reconciler and the control loops run without kopf here, so that every request counted is
one the step under test made; the watches they rely on are played by calling child_changed,
child_deleted and child_listed, as kopf's handlers do."""

from __future__ import annotations

import collections
import contextlib
import copy
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from fake_metrics import fake_metrics
from fake_pods import FakePod, serving
from kvpilot.operator import control, reconcile
from operator_harness import (
    NAMESPACE, SPEC, TEST_CLIENT, Cluster, cluster, key, reconciler_alone, run,
)

pytestmark = pytest.mark.timeout(120)

# Small, for the emulated API server's sake; the counts per engine do not depend on it.
FLEET = 4
ENGINES = [f"e{i}" for i in range(FLEET)]
FLEET_SPEC: dict[str, Any] = {
    **copy.deepcopy(SPEC),
    "scheduling": {**copy.deepcopy(SPEC["scheduling"]), "policy": "auto"},
    "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4},
}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def requests(k: Cluster, since: int) -> collections.Counter[str]:
    """The operator's requests after the first `since`, as 'METHOD plural[/subresource]'; a list
    is 'LIST', discovery is 'GET discovery'."""
    found: collections.Counter[str] = collections.Counter()
    for request in list(k.server)[since:]:
        if request.headers.get("User-Agent") == TEST_CLIENT:
            continue
        resource = request.resource
        if resource is None or not resource.plural:
            found["GET discovery"] += 1
            continue
        method = "LIST" if request.method == "GET" and not request.name else str(request.method.value)
        found[f"{method} {resource.plural}{'/' + request.subresource if request.subresource else ''}"] += 1
    return found


@contextlib.asynccontextmanager
async def fleet(tmp_path: Path, clock: Clock) -> AsyncIterator[tuple[Cluster, reconcile.Reconciler]]:
    async with cluster(tmp_path, service_monitors=True) as k, reconciler_alone(clock=clock) as reconciler:
        await k.create_secret("prod-key", {"api-key": key("sk-prod")})
        for name in ENGINES:
            await k.create_engine(name, FLEET_SPEC)
        yield k, reconciler


async def pass_over_the_fleet(k: Cluster, reconciler: reconcile.Reconciler) -> collections.Counter[str]:
    since = len(list(k.server))
    for name in ENGINES:
        await reconciler.reconcile(k.engine(name))
    return requests(k, since)


def test_a_pass_that_changes_nothing_reads_a_few_objects_and_applies_none(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = Clock()
        async with fleet(tmp_path, clock) as (k, reconciler):
            first = await pass_over_the_fleet(k, reconciler)
            # One answer for the whole fleet per optional kind: ServiceMonitors, LeaderWorkerSets.
            assert first["GET discovery"] == 2, "one discovery answer per optional kind for the whole fleet"
            assert first["PATCH services"] == FLEET and first["PATCH servicemonitors"] == FLEET

            again = await pass_over_the_fleet(k, reconciler)
            # Per engine: the tenant's key Secret, the Deployment and the engine for status.
            assert again == {"GET secrets": FLEET, "GET deployments": FLEET, "GET inferenceengines": FLEET}

            # Past the discovery answer's lifetime, the fleet asks once more.
            clock.now += reconcile.DISCOVERY_TTL_SECONDS
            assert (await pass_over_the_fleet(k, reconciler))["GET discovery"] == 2

    run(scenario())


def test_a_child_changed_or_deleted_is_applied_again_and_only_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with fleet(tmp_path, Clock()) as (k, reconciler):
            await pass_over_the_fleet(k, reconciler)
            service_url = f"/api/v1/namespaces/{NAMESPACE}/services/e0"
            rendered = k.object("v1/services", "e0")["spec"]
            await k.patch(service_url, {"spec": {"type": "NodePort"}})

            since = len(list(k.server))
            await reconciler.child_changed(k.object("v1/services", "e0"))  # its watch event
            found = requests(k, since)
            assert k.object("v1/services", "e0")["spec"] == rendered
            assert found["PATCH services"] == 1 and found["GET services"] == 2  # the event's check, then before
            assert not [r for r in found if r.startswith("PATCH") and r not in ("PATCH services",)]

            monitor_url = f"/apis/monitoring.coreos.com/v1/namespaces/{NAMESPACE}/servicemonitors/e1"
            monitor = k.object("monitoring.coreos.com/v1/servicemonitors", "e1")
            await k.delete(monitor_url)
            await reconciler.child_deleted(monitor)  # its watch event
            assert k.object("monitoring.coreos.com/v1/servicemonitors", "e1")["spec"] == monitor["spec"]

            # An edit that no watch streamed (it was reconnecting) shows in its next listing.
            await k.patch(service_url, {"spec": {"type": "NodePort"}})
            await reconciler.child_listed(k.object("v1/services", "e0"))
            assert k.object("v1/services", "e0")["spec"] == rendered

    run(scenario())


def test_listings_at_startup_cost_nothing(tmp_path: Path) -> None:
    # Every engine's resume applies its children: the listing of a child the operator has not
    # applied since it started starts nothing.
    async def scenario() -> None:
        async with fleet(tmp_path, Clock()) as (k, reconciler):
            await pass_over_the_fleet(k, reconciler)
            restarted = reconcile.Reconciler(reconciler.client)
            since = len(list(k.server))
            for name in ENGINES:
                await restarted.child_listed(k.object("v1/services", name))
                await restarted.child_listed(k.object("apps/v1/deployments", name))
            assert requests(k, since) == {}

    run(scenario())


def test_one_interval_of_the_control_loops_across_the_fleet(tmp_path: Path) -> None:
    async def scenario() -> None:
        clock = Clock()
        # Every engine's pods are this one, which runs priority while the engines run fcfs: the
        # first interval switches it back, with the admin token (which it does not check).
        pod = FakePod("priority", token=None)
        async with fleet(tmp_path, clock) as (k, reconciler), fake_metrics() as fake, serving(pod=pod) as urls:
            for name in ENGINES:
                for replica in range(2):
                    await k.create_pod(f"{name}-{replica}", name, ready=True)
                    fake.set([f"{name}-{replica}"], kv=0.5, waiting=1)
            await pass_over_the_fleet(k, reconciler)
            loops = control.ControlLoops(reconciler, pod_metrics_url=fake.pod_url, pod_url=lambda _: urls["pod"],
                                         clock=clock)
            try:
                for _ in range(2):
                    since = len(list(k.server))
                    for name in ENGINES:
                        await loops.tick(NAMESPACE, name)
                    clock.now += 15
                    # Per engine: the engine, its pods, the admin token (what the pods check), and
                    # one status write, reading the engine again inside the status lock, for both
                    # controllers: the autoscaler's (the reading's time changes every interval) and
                    # the tuner's (its windows, kept in status.controlMemory for the next leader).
                    # The scheduling ConfigMap is as the operator left it (its watch would have said
                    # otherwise): not read.
                    assert requests(k, since) == {"GET inferenceengines": 2 * FLEET, "LIST pods": FLEET,
                                                  "GET secrets": FLEET, "PATCH inferenceengines/status": FLEET}
                assert pod.policy == "fcfs" and set(pod.switches) == {"fcfs"}
                assert pod.tokens == {_admin_token(k, "e0")}, "switched with the token in the engine's Secret"
                assert pod.health_reads == 2 * 2 * FLEET  # each ready pod read back, every interval
            finally:
                await loops.close()

    run(scenario())


def _admin_token(k: Cluster, engine: str) -> str | None:
    secret = k.object("v1/secrets", f"{engine}-admin-token")
    return reconcile.decoded_token(secret["data"]["token"])


def test_children_that_no_watch_follows_are_applied_every_pass(tmp_path: Path) -> None:
    # ServiceMonitors whose CRD was installed after the operator started: only a pass brings a
    # deleted one back.
    async def scenario() -> None:
        async with fleet(tmp_path, Clock()) as (k, watched):
            reconciler = reconcile.Reconciler(watched.client, unwatched_kinds=frozenset({"ServiceMonitor"}))
            await pass_over_the_fleet(k, reconciler)
            await k.delete(f"/apis/monitoring.coreos.com/v1/namespaces/{NAMESPACE}/servicemonitors/e0")
            again = await pass_over_the_fleet(k, reconciler)
            assert again["PATCH servicemonitors"] == FLEET
            assert not [r for r in again if r.startswith("PATCH") and r != "PATCH servicemonitors"]
            assert k.object("monitoring.coreos.com/v1/servicemonitors", "e0") is not None

    run(scenario())
