"""Leader election: the Lease rules as pure functions, then two electors racing for one Lease on
the emulated API server, and a leader cut off from it stopping before its Lease can expire."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
from collections.abc import AsyncIterator
from pathlib import Path

import kopf
import pytest

from emulated_apiserver import Fault
from kvpilot.operator import kube, leader, leader_election
from kvpilot.operator.leader_election import LeaseSettings, Observation
from operator_api_calls import used
from operator_harness import NAMESPACE, cluster, run

WALL = datetime.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=datetime.UTC)
SHORT = LeaseSettings(lease_duration=1.0, renew_deadline=0.6, retry_period=0.2)


def lease(holder: str, *, version: str = "7", transitions: int = 2, renewed: str = "r1") -> dict:
    return {"metadata": {"name": "ops", "namespace": NAMESPACE, "resourceVersion": version},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15, "acquireTime": "a0",
                     "renewTime": renewed, "leaseTransitions": transitions}}


def test_controller_runtimes_defaults_keep_leaders_apart() -> None:
    assert (LeaseSettings().lease_duration, LeaseSettings().renew_deadline, LeaseSettings().retry_period) == (15, 10, 2)
    assert LeaseSettings().problems() == []


@pytest.mark.parametrize(("settings", "expected"), [
    (LeaseSettings(10, 10, 2), "must be shorter than the lease duration"),
    (LeaseSettings(15, 2, 2), "must exceed 1.2 x the retry period"),
])
def test_settings_that_could_let_two_leaders_overlap_are_refused(settings: LeaseSettings, expected: str) -> None:
    assert any(expected in problem for problem in settings.problems())


def observe(current: dict | None, previous: Observation | None, sent: float, received: float) -> Observation:
    return Observation.of(current, previous, sent=sent, received=received, settings=LeaseSettings())


def test_a_renewal_seen_between_two_reads_counts_from_the_first_of_them() -> None:
    held = lease("other")
    before = observe(held, None, sent=99.0, received=100.0)
    unchanged = observe(held, before, sent=102.0, received=102.1)
    assert unchanged.since == before.since and unchanged.checked == 102.0
    # The renewal landed after the read sent at 102.0: the lease (15 s) runs from then, so a
    # standby that wakes at 117.0 takes over within one lease duration of the last renewal.
    renewed = observe(lease("other", renewed="r2"), unchanged, sent=104.0, received=104.1)
    assert renewed.expires_at == 117.0
    assert not leader_election.may_take(held, renewed, "me", now=116.9)
    assert leader_election.may_take(held, renewed, "me", now=117.0)


def test_a_renewal_is_never_counted_so_early_that_its_writer_may_still_act() -> None:
    # Its writer stops 10 s (the renew deadline) after it sent the renewal, before the read that
    # showed it returned at 130.0: whatever the previous read, the lease runs at least that long.
    for previous in (None, observe(lease("other"), None, sent=99.0, received=100.0)):
        renewed = observe(lease("other", renewed="r2"), previous, sent=129.0, received=130.0)
        assert renewed.expires_at == 140.0
        assert not leader_election.may_take(lease("other"), renewed, "me", now=139.9)


@pytest.mark.parametrize("current", [None, lease(""), lease("me")])
def test_a_missing_released_or_own_lease_may_be_taken_at_once(current: dict | None) -> None:
    assert leader_election.may_take(current, observe(current, None, sent=0.0, received=0.0), "me", now=0.0)


def test_claims_carry_the_version_read_and_count_transitions() -> None:
    make = dict(name="ops", namespace=NAMESPACE, identity="me", settings=LeaseSettings(), wall=WALL)
    created = leader_election.claimed(None, **make)
    assert "resourceVersion" not in created["metadata"]
    assert created["spec"] == {"holderIdentity": "me", "leaseDurationSeconds": 15,
                               "acquireTime": "2026-01-02T03:04:05.678901Z",
                               "renewTime": "2026-01-02T03:04:05.678901Z", "leaseTransitions": 0}
    taken = leader_election.claimed(lease("other"), **make)
    assert taken["metadata"]["resourceVersion"] == "7"
    assert (taken["spec"]["leaseTransitions"], taken["spec"]["acquireTime"]) == (3, "2026-01-02T03:04:05.678901Z")
    renewed = leader_election.claimed(lease("me"), **make)
    assert (renewed["spec"]["leaseTransitions"], renewed["spec"]["acquireTime"]) == (2, "a0")


@contextlib.asynccontextmanager
async def electors(*names: str) -> AsyncIterator[list[leader.Elector]]:
    clients = [kube.Kube(kopf.OperatorSettings()) for _ in names]
    try:
        yield [leader.Elector(client, name="ops", namespace=NAMESPACE, identity=name, settings=SHORT)
               for client, name in zip(clients, names, strict=True)]
    finally:
        for client in clients:
            await client.close()


def held_by(k: object) -> str:
    found = k.object("coordination.k8s.io/v1/leases", "ops")  # type: ignore[attr-defined]
    return leader_election.holder(found)


def test_one_of_two_candidates_leads_and_the_other_takes_over_once_renewals_stop(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k:
            async with electors("a", "b") as (a, b):
                first = asyncio.create_task(a.acquire())
                await asyncio.wait_for(first, 5)
                second = asyncio.create_task(b.acquire())
                holding = asyncio.create_task(a.hold())
                # Several lease durations: renewals keep b standing by.
                done, _ = await asyncio.wait({second}, timeout=3 * SHORT.lease_duration)
                assert not done and held_by(k) == "a"
                holding.cancel()  # a dies: no renewal, no release
                stopped = time.monotonic()
                await asyncio.wait_for(second, 5)
                taken = time.monotonic() - stopped
                assert held_by(k) == "b"
                lease_now = k.object("coordination.k8s.io/v1/leases", "ops")
                assert lease_now["spec"]["leaseTransitions"] == 1
                # Not before a could have stopped, and within one lease duration of its death (with
                # a margin for this loop's own delays, not a polling period).
                assert b.renewed_at >= a.renewed_at + SHORT.renew_deadline
                assert taken <= SHORT.lease_duration + 0.2
                await b.release()
                assert held_by(k) == ""
            # The chart's Role for the Lease grants these (tests/packaging checks it).
            assert used(k) == {("coordination.k8s.io", "leases", verb) for verb in ("get", "create", "patch")}

    run(scenario())


def test_two_candidates_for_a_free_lease_one_wins(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k:
            async with electors(*"abcd") as candidates:
                # Each reads the Lease missing, then creates it: the API server lets one through.
                tasks = [asyncio.create_task(c.acquire()) for c in candidates]
                done, _ = await asyncio.wait(tasks, timeout=5, return_when=asyncio.FIRST_COMPLETED)
                await asyncio.wait(tasks, timeout=SHORT.lease_duration / 2)
                winners = [c.identity for c, task in zip(candidates, tasks, strict=True) if task.done()]
                for task in tasks:
                    task.cancel()
                assert len(done) == 1 and winners == [held_by(k)]

    run(scenario())


def test_a_leader_cut_off_from_the_api_server_stops_before_its_lease_can_expire(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k:
            async with electors("a") as (a,):
                await asyncio.wait_for(a.acquire(), 5)
                holding = asyncio.create_task(a.hold())
                await asyncio.sleep(2 * SHORT.retry_period)
                k.server.inject(Fault(lambda r: r.resource.plural == "leases", status=503, times=None))
                await asyncio.wait_for(holding, 5)
                stopped = time.monotonic()
                # Counted from when the last renewal that succeeded was sent: a standby saw it no
                # earlier, and waits a lease duration from then.
                assert a.renewed_at is not None
                assert a.renewed_at + SHORT.renew_deadline <= stopped < a.renewed_at + SHORT.lease_duration
                assert held_by(k) == "a"

    run(scenario())
