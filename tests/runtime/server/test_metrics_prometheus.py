"""The operator's Prometheus metrics source against a real Prometheus scraping two real
`kvpilot serve` processes, labelled as a ServiceMonitor scrape labels pods: it sees the queue and
the KV-cache usage of the loaded engine rise, the idle one stay at 0, and both fall back to 0."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import aiohttp
import httpx
import pytest

from kvpilot.operator import metrics, samples
from prometheus_server import PrometheusServer, Target, fetch_prometheus, scrape_config, scrape_job
from server_harness import HTTP_TIMEOUT_S, start_server

pytestmark = pytest.mark.timeout(300)

LOADED, IDLE = "qwen-5f7b9-x2k4q", "qwen-5f7b9-m8z1v"
# Short, so that the test is quick: Prometheus scrapes every second and the source averages
# over 3 s (the operator's default is 1m).
SCRAPE_INTERVAL = "1s"
WINDOW = "3s"
CONCURRENT = 12
WAIT_S = 60.0


@pytest.fixture(scope="module")
def loaded_server(tiny_llama_dir, tmp_path_factory):
    # Two sequences at a time: the rest of the load waits in the queue.
    process = start_server(tiny_llama_dir, tmp_path_factory.mktemp("loaded"), "--served-model-name", "tiny",
                           "--max-num-seqs", "2")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def prometheus(loaded_server, server, tmp_path_factory):
    binary = fetch_prometheus()
    targets = [Target(loaded_server.base_url.removeprefix("http://"), "ml", LOADED, "qwen"),
               Target(server.base_url.removeprefix("http://"), "ml", IDLE, "qwen")]
    config = scrape_config([scrape_job("kvpilot", targets, SCRAPE_INTERVAL)], SCRAPE_INTERVAL)
    process = PrometheusServer(binary, tmp_path_factory.mktemp("prometheus"), config)
    yield process
    process.stop()


def pod(name: str) -> dict:
    return {"metadata": {"name": name, "namespace": "ml"}}


@contextlib.asynccontextmanager
async def load(base_url: str) -> AsyncIterator[None]:
    """Keep CONCURRENT completions in flight until the block ends."""
    async with httpx.AsyncClient(base_url=base_url, timeout=HTTP_TIMEOUT_S) as client:
        async def one_after_another(i: int) -> None:
            while True:
                body = {"prompt": f"Request {i} asks about the library", "max_tokens": 64, "ignore_eos": True}
                response = await client.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text

        workers = [asyncio.create_task(one_after_another(i)) for i in range(CONCURRENT)]
        try:
            yield
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)


async def until(source: metrics.Prometheus, check, what: str) -> samples.Reading:
    """Read both pods until `check(reading)` holds; fail, saying what was awaited, after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while True:
        reading = await source.read("ml", [pod(LOADED), pod(IDLE)], time.time(), latencies=True)
        assert reading.failure is None, reading.failure
        if check(reading):
            return reading
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {WAIT_S} s waiting for {what}; last reading: {reading}")
        await asyncio.sleep(0.5)


def both_idle(reading: samples.Reading) -> bool:
    return set(reading.samples) == {LOADED, IDLE} and all(
        s.num_waiting == 0 and s.num_running == 0 and s.kv_cache_usage == 0 for s in reading.samples.values())


def test_the_prometheus_source_follows_one_engines_load(prometheus, loaded_server) -> None:
    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            source = metrics.Prometheus(session, prometheus.url, timeout=5, window=WINDOW)
            first = await until(source, both_idle, "both engines, idle, in Prometheus")
            assert all(time.time() - s.observed_at < 10 for s in first.samples.values())

            async with load(loaded_server.base_url):
                busy = await until(source, lambda r: LOADED in r.samples and r.samples[LOADED].num_waiting > 1
                                   and r.samples[LOADED].kv_cache_usage > 0, "the loaded engine's queue and KV usage")
                assert busy.samples[LOADED].num_running > 0
                # The idle pod is the session's shared server: its finished counter and latency
                # histograms hold what other tests sent it, and must not move while only the loaded
                # pod gets requests.
                idle, was = busy.samples[IDLE], first.samples[IDLE]
                assert idle == samples.PodSample(IDLE, 0, 0, 0, idle.observed_at, was.num_finished, was.ttft, was.itl)
                assert idle.num_finished is not None and idle.ttft is not None and idle.itl is not None

            calm = await until(source, both_idle, "the loaded engine back to 0")
            assert calm.samples[LOADED].num_finished > (first.samples[LOADED].num_finished or 0)
            # Its latency histograms' buckets, through `sum by (pod, le)`, counted the load's requests.
            for name in ("ttft", "itl"):
                (_, total), (_, before) = getattr(calm.samples[LOADED], name)[-1], getattr(first.samples[LOADED], name)[-1]
                assert total > before, name

        # A pod that Prometheus does not scrape is missing, by name.
        async with aiohttp.ClientSession() as session:
            source = metrics.Prometheus(session, prometheus.url, timeout=5, window=WINDOW)
            reading = await source.read("ml", [pod(LOADED), pod("qwen-5f7b9-other")], time.time())
            assert set(reading.samples) == {LOADED}
            assert reading.problems["qwen-5f7b9-other"].reason == samples.MISSING

    asyncio.run(scenario())
