"""Two `kvpilot operator --leader-elect` processes against one emulated API server: one writes at a
time (told apart by their tokens in the request log), the standby takes over when the leader is
killed or cut off from the API server, and a scale that was pending at the failover happens when
a single operator would have made it."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from emulated_apiserver import Fault
from fake_metrics import fake_metrics
from kvpilot.operator import leader_election, run as operator_run
from operator_harness import NAMESPACE, SPEC, Cluster, cluster, created, eventually, free_port, run, write_kubeconfig
from operator_process import healthy, leads, start

pytestmark = pytest.mark.timeout(120)

LEASE_DURATION, RENEW_DEADLINE, RETRY_PERIOD = 2.0, 1.5, 0.4
# One lease duration after the leader's death; the rest is this loaded machine's scheduling of
# the two processes and the emulated API server.
TAKEOVER_BOUND = LEASE_DURATION + 1.0
STARTUP_TIMEOUT = 30


@contextlib.asynccontextmanager
async def operator_process(
    k: Cluster, tmp_path: Path, token: str, liveness: str = "", metrics: str = "",
) -> AsyncIterator[asyncio.subprocess.Process]:
    kubeconfig = write_kubeconfig(tmp_path / f"kubeconfig-{token}", k.url, token)
    log = tmp_path / f"operator-{token}.log"
    process = await start(
        log, "--liveness-endpoint", liveness, "--metrics-endpoint", metrics, "--leader-elect", "--leader-elect-resource-namespace", NAMESPACE,
        "--leader-elect-lease-duration", str(LEASE_DURATION), "--leader-elect-renew-deadline", str(RENEW_DEADLINE),
        "--leader-elect-retry-period", str(RETRY_PERIOD), env={"KUBECONFIG": str(kubeconfig)},
    )
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
        print(f"--- operator {token} ---\n{log.read_text()[-3000:]}")


def lease_holder(k: Cluster) -> str:
    return leader_election.holder(k.object("coordination.k8s.io/v1/leases", "kvpilot-operator"))


def writers(k: Cluster) -> list[str]:
    """Who made each write, in the order the API server received them (the tests' own left out)."""
    return [request.headers["Authorization"].removeprefix("Bearer ") for request in k.server
            if request.method != "GET" and "Authorization" in request.headers]


async def leading(k: Cluster, process: asyncio.subprocess.Process) -> str:
    holder = await eventually(lambda: lease_holder(k), "a leader", timeout=STARTUP_TIMEOUT)
    assert process.returncode is None
    return holder


def test_the_standby_takes_over_from_a_killed_leader_and_scales_when_a_single_operator_would(tmp_path: Path) -> None:
    window = 8  # scaleUpStabilizationSeconds: much longer than the failover

    async def scenario() -> None:
        async with cluster(tmp_path) as k, fake_metrics() as fake, operator_process(k, tmp_path, "a") as a:
            first = await leading(k, a)
            async with operator_process(k, tmp_path, "b") as b:
                await k.create_pod("qwen-a", "qwen", ready=True)
                fake.set(["qwen-a"], kv=0.4)
                await created(k, {**SPEC, "replicas": 1, "autoscaling": {
                    "enabled": True, "maxReplicas": 3, "intervalSeconds": 1, "scaleUpStabilizationSeconds": window,
                    "prometheus": {"url": fake.url}}})
                await eventually(lambda: memory(k).get("recommendations"), "the leader's first interval")
                # The load asks for 2 replicas; the window holds the scale-up back.
                loaded = time.monotonic()
                fake.set(["qwen-a"], kv=1.0)
                await eventually(lambda: 2 in [r for _, r in memory(k)["recommendations"]], "a recommendation of 2")
                a.send_signal(signal.SIGKILL)
                killed = time.monotonic()
                await eventually(lambda: lease_holder(k) not in ("", first), "the standby to lead",
                                 timeout=TAKEOVER_BOUND + 1)
                assert time.monotonic() - killed <= TAKEOVER_BOUND
                await eventually(lambda: k.engine("qwen")["spec"]["replicas"] == 2, "the pending scale-up",
                                 timeout=window + 5)
                scaled = time.monotonic()
                assert b.returncode is None

            # The single operator's timeline: every recommendation of the window (which began
            # with the first reading of the load) must be 2 before it scales. A standby that
            # started afresh would have scaled at its first interval, about 4 s after the load.
            assert scaled - loaded >= window - 1.0
            order = writers(k)
            assert set(order) == {"a", "b"}
            assert order == sorted(order), "a write by the killed leader after the new one's first"
            scales = [r for r in k.server if r.subresource == "scale" and "Authorization" in r.headers]
            assert len(scales) == 1

    run(scenario())


def test_a_leader_cut_off_from_the_api_server_stops_before_the_standby_starts(tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()

    async def scenario() -> None:
        async with cluster(tmp_path) as k, operator_process(k, tmp_path, "a") as a:
            first = await leading(k, a)
            liveness, metrics = f"http://127.0.0.1:{port}/healthz", f"http://127.0.0.1:{metrics_port}/metrics"
            async with operator_process(k, tmp_path, "b", liveness, metrics) as b:
                await created(k)
                # b stands by: it reads the Lease, writes nothing, is alive for the kubelet, and
                # tells Prometheus that it does not lead.
                await eventually(lambda: healthy(port), "the standby's liveness endpoint", timeout=STARTUP_TIMEOUT)
                assert await leads(metrics_port) == 0
                assert set(writers(k)) == {"a"}
                k.server.inject(Fault(lambda r: r.headers.get("Authorization") == "Bearer a", status=503, times=None))
                exited = asyncio.create_task(_exit_time(a))
                taken = await eventually(lambda: lease_holder(k) not in ("", first) and time.monotonic(),
                                         "the standby to lead", timeout=TAKEOVER_BOUND + RENEW_DEADLINE)
                assert a.returncode == operator_run.LEASE_LOST_EXIT
                assert await exited < taken, "the cut-off leader still ran when the standby took over"
                # The new leader acts: a spec change reaches the Deployment.
                await k.update_engine("qwen", lambda spec: spec.update(replicas=3))
                await eventually(lambda: k.deployment("qwen")["spec"]["replicas"] == 3, "the new leader's apply")
                assert await healthy(port), "kopf's liveness endpoint, where the standby's was"
                assert await leads(metrics_port) == 1
                # Stopped cleanly, the leader hands the Lease back rather than let it expire.
                b.send_signal(signal.SIGTERM)
                await asyncio.wait_for(b.wait(), 15)
                assert b.returncode == 0 and lease_holder(k) == ""

    run(scenario())


async def _exit_time(process: asyncio.subprocess.Process) -> float:
    await process.wait()
    return time.monotonic()


def memory(k: Cluster) -> dict[str, Any]:
    return (k.engine("qwen").get("status") or {}).get("controlMemory", {}).get("autoscaler", {})
