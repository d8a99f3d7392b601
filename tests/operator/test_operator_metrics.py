"""The metrics sources' I/O: pods read at once with a timeout each, and whatever the other side
answers (or fails to) becomes a sample or a Problem. Also which pods count as ready."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from fake_metrics import SLOW_SECONDS, fake_metrics
from kvpilot.operator import control, metrics, samples

pytestmark = pytest.mark.timeout(60)


def pod(name: str, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ml"}, "status": status}


def test_a_slow_pod_times_out_alone_and_the_others_are_read() -> None:
    async def scenario() -> samples.Reading:
        async with fake_metrics() as fake, aiohttp.ClientSession() as session:
            fake.set(["fast", "slow"], kv=0.25, waiting=1)
            fake.slow.add("slow")
            source = metrics.DirectScrape(session, timeout=SLOW_SECONDS / 10, url_of=fake.pod_url)
            return await source.read("ml", [pod("fast"), pod("slow"), pod("gone")], 100.0)

    reading = asyncio.run(scenario())
    assert reading.samples == {"fast": samples.PodSample("fast", 0.25, 1, 0, 100.0, num_finished=0.0)}
    assert reading.problems["slow"].reason == samples.MISSING and "TimeoutError" in reading.problems["slow"].message
    assert reading.problems["gone"] == samples.Problem(samples.MISSING, "pod gone: GET /metrics answered 404")


def test_pod_urls_come_from_the_pod_ip_and_the_container_port() -> None:
    assert metrics.pod_metrics_url(pod("a", podIP="10.1.2.3")) == "http://10.1.2.3:8000/metrics"
    assert metrics.pod_metrics_url(pod("a", podIP="fd00::7")) == "http://[fd00::7]:8000/metrics"
    assert metrics.pod_metrics_url(pod("a")) is None

    async def no_ip() -> samples.Reading:
        async with aiohttp.ClientSession() as session:
            return await metrics.DirectScrape(session, timeout=1).read("ml", [pod("a")], 0.0)

    assert asyncio.run(no_ip()).problems["a"] == samples.Problem(samples.MISSING, "pod a has no IP yet")


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def prometheus_answering(status: int, body: str) -> samples.Reading:
    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=status, text=body, content_type="application/json")

    app = web.Application()
    app.router.add_post("/api/v1/query", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as session:
            return await metrics.Prometheus(session, f"http://127.0.0.1:{port}/", timeout=2).read("ml", [pod("a")], 0)
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(("status", "body", "reason", "words"), [
    (200, "<html>login</html>", samples.INVALID, "answered 200: Expecting value"),
    (200, '{"status": "success", "data": {"resultType": "matrix", "result": []}}', samples.INVALID,
     "not an instant vector"),
    (401, "Unauthorized", samples.UNREACHABLE, "answered 401"),
    (503, '{"status": "error", "error": "overloaded"}', samples.UNREACHABLE, "answered 503"),
])
def test_bad_prometheus_answers_fail_the_read(status: int, body: str, reason: str, words: str) -> None:
    reading = asyncio.run(prometheus_answering(status, body))
    assert reading.samples == {} and reading.failure is not None
    assert reading.failure.reason == reason and words in reading.failure.message


def test_an_unreachable_prometheus_fails_the_read() -> None:
    async def scenario() -> samples.Reading:
        async with aiohttp.ClientSession() as session:
            source = metrics.Prometheus(session, f"http://127.0.0.1:{closed_port()}", timeout=2)
            return await source.read("ml", [pod("a")], 0.0)

    failure = asyncio.run(scenario()).failure
    assert failure is not None and failure.reason == samples.UNREACHABLE and "/api/v1/query" in failure.message


def test_an_empty_answer_leaves_each_pod_missing() -> None:
    empty = '{"status": "success", "data": {"resultType": "vector", "result": []}}'
    reading = asyncio.run(prometheus_answering(200, empty))
    assert reading.failure is None
    assert reading.problems == {"a": samples.Problem(samples.MISSING, "Prometheus has no vllm:kv_cache_usage_perc of pod a")}


def test_timeouts_are_a_third_of_the_interval_at_most_five_seconds() -> None:
    assert metrics.request_timeout(1) == pytest.approx(1 / 3)
    assert metrics.request_timeout(15) == 5.0


def ready(value: bool) -> dict[str, Any]:
    return {"type": "Ready", "status": "True" if value else "False"}


def test_ready_and_starting_pods() -> None:
    pods = [
        pod("ready", phase="Running", conditions=[ready(True)]),
        pod("starting", phase="Running", conditions=[ready(False)]),
        pod("pending", phase="Pending"),
        pod("done", phase="Succeeded", conditions=[ready(False)]),
        pod("crashed", phase="Failed", conditions=[ready(False)]),
        {**pod("leaving", phase="Running", conditions=[ready(True)]),
         "metadata": {"name": "leaving", "deletionTimestamp": "2026-01-01T00:00:00Z"}},
    ]
    found, starting = control.pod_states(pods)
    assert [metrics.pod_name(p) for p in found] == ["ready"] and starting == 2
