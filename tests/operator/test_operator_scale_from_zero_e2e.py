"""Scale from zero, end to end: the real kopf operator against the emulated API server, a real
`kvpilot router`, and a stand-in kubelet (kubelet.py) that starts a real `kvpilot serve` (the tiny
model) when the engine's Deployment goes from 0 to 1 replica, and stops it at 0.
"""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any

import httpx
import pytest

from kubelet import Kubelet
from operator_harness import SPEC, Cluster, cluster, created, eventually, operator
from server_harness import HTTP_TIMEOUT_S  # on sys.path once kubelet is imported

pytestmark = pytest.mark.timeout(420)

IDLE_SECONDS = 3
ENGINE = {
    **copy.deepcopy(SPEC), "replicas": 0,
    "routing": {"enabled": True, "holdTimeoutSeconds": 180},
    "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 1, "intervalSeconds": 1,
                    "scaleToZeroAfterSeconds": IDLE_SECONDS},
}
AUTH = {"Authorization": "Bearer sk-prod"}
PROMPT = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}


def _replicas_ready(router: str) -> int:
    return httpx.get(f"{router}/health", timeout=HTTP_TIMEOUT_S).json()["replicas_ready"]


def replicas(k: Cluster) -> int:
    return k.engine("qwen")["spec"]["replicas"]


def test_a_request_at_zero_wakes_the_engine_and_idleness_puts_it_back(tiny_llama_dir, tmp_path, capsys):
    async def scenario() -> None:
        async with cluster(tmp_path) as k:
            kubelet = Kubelet(k, tiny_llama_dir, tmp_path)
            async with operator(pod_metrics_url=kubelet.metrics_url), httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as client:
                await created(k, ENGINE)
                await eventually(lambda: k.object("v1/secrets", "qwen-cache-salt"), "the salt Secret")
                await kubelet.start_router(ENGINE["routing"]["holdTimeoutSeconds"])
                kubelet_task = asyncio.create_task(kubelet.run())
                try:
                    router = kubelet.router.base_url

                    async def ask(prompt: dict[str, Any] = PROMPT) -> tuple[httpx.Response, float]:
                        sent = time.monotonic()
                        response = await client.post(f"{router}/v1/completions", json=prompt, headers=AUTH)
                        return response, sent

                    # At zero, the first request is held; the operator scales on it, once.
                    first = asyncio.create_task(ask())
                    await eventually(lambda: replicas(k) == 1, "scaled up from zero", timeout=30)
                    (up,) = await eventually(lambda: k.events("ScaledUp"), "a ScaledUp event")
                    assert up["message"] == "0 -> 1 replicas: the routers hold 1 requests and no replica runs"
                    response, sent = await first
                    answered = time.monotonic()
                    assert response.status_code == 200, response.text
                    direct = await client.post(f"{kubelet.engine.base_url}/v1/completions", json=PROMPT, headers=AUTH)
                    assert response.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
                    assert len(k.events("ScaledUp")) == 1
                    first_wait = answered - sent, kubelet.started[0] - sent

                    # Idle past scaleToZeroAfterSeconds: back to zero, the engine stopped.
                    await eventually(lambda: replicas(k) == 0, "scaled back to zero", timeout=IDLE_SECONDS + 30)
                    await eventually(lambda: kubelet.engine is None, "the engine stopped", timeout=60)
                    await eventually(lambda: _replicas_ready(router) == 0, "the router to see no replica")

                    # The next request wakes it again.
                    response, sent = await ask()
                    assert response.status_code == 200, response.text
                    # kopf posts Events from a queue of its own: the second may trail the answer.
                    await eventually(lambda: len(k.events("ScaledUp")) == 2, "a second ScaledUp event")
                    second_wait = time.monotonic() - sent, kubelet.started[1] - sent

                    # A request sent the moment the scale-down is decided is served by the draining
                    # replica or held and woken for: never lost.
                    await eventually(lambda: replicas(k) == 0, "scaled to zero again", timeout=IDLE_SECONDS + 30)
                    response, _ = await ask()
                    assert response.status_code == 200, response.text
                    with capsys.disabled():
                        for name, (waited, engine_up) in (("first", first_wait), ("second", second_wait)):
                            print(f"\n{name} request at zero: answered after {waited:.1f} s, of which "
                                  f"{engine_up:.1f} s until the engine's /health answered")
                finally:
                    kubelet_task.cancel()
                    for server in (kubelet.engine, kubelet.router):
                        if server is not None:
                            await asyncio.to_thread(server.stop)

    asyncio.run(asyncio.wait_for(scenario(), 400))
