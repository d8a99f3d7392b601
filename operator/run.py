"""`kvpilot operator`: run the kopf operator with kvpilot's handlers and a liveness endpoint,
alone or as one of several replicas behind a Lease (`LeaderElection`).

With leader election, a replica stands by (serving liveness and a metrics page that says it does
not lead, reading only its Lease) until it holds the Lease, then runs kopf. One that cannot renew within the renew deadline ends its process
at once, as controller-runtime's manager does: kopf stops no faster than its handlers finish, and
the next leader may start a lease duration after the last renewal. The pod's restart makes it a
standby. On SIGTERM the leader stops kopf and hands the Lease back, so that a rolling update
waits for no expiry.

Why not kopf's peering: peers of one priority all pause (a Deployment's replicas share theirs),
it needs its own CRD, and a peer cut off from the API server keeps acting; a Lease has none of
these problems.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any
from urllib.parse import urlsplit

import aiohttp.web
import kopf

from kvpilot.operator import exported_metrics, handlers, kube, leader
from kvpilot.operator.leader_election import LeaderElection

logger = logging.getLogger(__name__)

# The exit status of a leader that lost its Lease.
LEASE_LOST_EXIT = 3


def run_operator(
    *,
    namespaces: Sequence[str],
    clusterwide: bool,
    liveness_endpoint: str | None,
    metrics_endpoint: str | None,
    log_level: str,
    log_format: str,
    leader_election: LeaderElection | None = None,
) -> None:
    """Run until SIGTERM/SIGINT. Watches `namespaces`, or every namespace when `clusterwide`."""
    kopf.configure(
        debug=log_level == "debug",
        quiet=log_level == "warning",
        log_format=kopf.LogFormat[log_format.upper()],
    )
    operator = functools.partial(
        kopf.operator,
        registry=handlers.registry,
        # No kopf peering: leader election, where there is more than one replica, is the Lease's.
        standalone=True,
        namespaces=list(namespaces),
        clusterwide=clusterwide,
        liveness_endpoint=liveness_endpoint,
        memo=kopf.Memo(metrics_endpoint=metrics_endpoint),
    )
    if leader_election is None:
        asyncio.run(operator())
    else:
        asyncio.run(_lead(operator, leader_election, liveness_endpoint, metrics_endpoint))


async def _lead(
    operator: Callable[[], Coroutine[Any, Any, None]], election: LeaderElection, liveness_endpoint: str | None,
    metrics_endpoint: str | None,
) -> None:
    client = kube.Kube(kopf.OperatorSettings())
    elector = leader.Elector(client, name=election.name, namespace=election.namespace,
                             identity=leader.identity(), settings=election.settings)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    try:
        async with _standby_liveness(liveness_endpoint), _standby_metrics(metrics_endpoint):
            acquiring = asyncio.create_task(elector.acquire())
            stopped = asyncio.create_task(stopping.wait())
            await asyncio.wait({acquiring, stopped}, return_when=asyncio.FIRST_COMPLETED)
            for task in (acquiring, stopped):
                task.cancel()
        if acquiring.cancelled():
            return  # stopped while standing by
        acquiring.result()  # a failure here is a bug: end the process rather than lead
        if stopping.is_set():
            await elector.release()  # took the Lease as the stop came
            return
        # kopf puts its own SIGTERM/SIGINT handlers in place of these.
        running = asyncio.create_task(operator())
        holding = asyncio.create_task(elector.hold())
        await asyncio.wait({running, holding}, return_when=asyncio.FIRST_COMPLETED)
        if holding.done():
            logger.error("Lost the Lease: stopping at once, so that the next leader writes alone")
            for handler in logging.getLogger().handlers:
                handler.flush()
            sys.stderr.flush()
            os._exit(LEASE_LOST_EXIT)
        holding.cancel()
        await elector.release()
        running.result()
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def _standby_metrics(endpoint: str | None) -> AsyncIterator[None]:
    """Serve the standby's metrics page, where kopf's startup will serve the leader's."""
    if endpoint is None:
        yield
        return
    runner = await exported_metrics.serve(endpoint, exported_metrics.standby_page)
    try:
        yield
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def _standby_liveness(endpoint: str | None) -> AsyncIterator[None]:
    """Serve the liveness probe while standing by, where kopf will serve it once leading."""
    if endpoint is None:
        yield
        return
    parts = urlsplit(endpoint)
    app = aiohttp.web.Application()
    app.router.add_get(parts.path or "/", lambda _: aiohttp.web.json_response({"standby": True}))
    runner = aiohttp.web.AppRunner(app, access_log=None)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, parts.hostname, parts.port or 80, reuse_address=True).start()
    try:
        yield
    finally:
        await runner.cleanup()
