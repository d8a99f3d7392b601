"""Scale from zero, end to end: the real kopf operator against the emulated API server, a real
`kvpilot router`, and a stand-in kubelet that starts a real `kvpilot serve` (the tiny model) when
the engine's Deployment goes from 0 to 1 replica, and stops it at 0.

The kubelet lays out what the pods mount (the tenants file and its keys, the cache salt) from the
objects the operator rendered, and tells the router about the replica through a backends file,
where a cluster's EndpointSlices would (the router's EndpointSlice watch has its own tests).
"""

from __future__ import annotations

import asyncio
import base64
import copy
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from operator_harness import NAMESPACE, SPEC, Cluster, cluster, created, eventually, operator
from kvpilot.operator import pod_parts

sys.path.insert(0, str(Path(__file__).parents[1] / "runtime" / "server"))  # the real-server harness
from server_harness import HTTP_TIMEOUT_S, ServerProcess, start_server  # noqa: E402

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


class Kubelet:
    """The engine's Deployment controller and kubelet in one: a pod and a real `kvpilot serve` per
    replica (0 or 1 here), ready once its /health answers; the router's backends file lists it."""

    def __init__(self, k: Cluster, model_dir: Path, workdir: Path) -> None:
        self.k, self.model_dir, self.workdir = k, model_dir, workdir
        self.backends = workdir / "backends"
        self.backends.write_text("")
        self.engine: ServerProcess | None = None
        self.router: ServerProcess | None = None
        self.started: list[float] = []  # when each engine answered its first /health (monotonic)

    def mounts(self) -> list[str]:
        """The tenants file, its keys and the cache salt, as the rendered objects have them."""
        keys = self.workdir / "tenant-keys"
        keys.mkdir(exist_ok=True)
        for name, value in self._object("secrets", "qwen-tenant-keys")["data"].items():
            (keys / name).write_bytes(base64.b64decode(value))
        tenants = self._object("configmaps", "qwen-config")["data"]["tenants.yaml"]
        (self.workdir / "tenants.yaml").write_text(tenants.replace(pod_parts.TENANT_KEYS_DIR, str(keys)))
        salt = self._object("secrets", "qwen-cache-salt")["data"][pod_parts.CACHE_SALT_KEY]
        (self.workdir / "salt").write_bytes(base64.b64decode(salt))
        return ["--tenants-file", str(self.workdir / "tenants.yaml"),
                "--cache-salt-secret-file", str(self.workdir / "salt")]

    async def start_router(self) -> None:
        self.router = await asyncio.to_thread(
            start_server, self.model_dir, self.workdir, "--backends-file", str(self.backends), "--hold-timeout",
            str(ENGINE["routing"]["holdTimeoutSeconds"]), *self.mounts(), subcommand="router")
        await self.k.create_pod("qwen-router-a", "qwen", ready=True, router=True)
        await self.k.roll_out("qwen-router")

    async def run(self) -> None:
        while True:
            wanted = self.k.deployment("qwen")["spec"]["replicas"]
            if wanted and self.engine is None:
                await self._start_engine()
            elif not wanted and self.engine is not None:
                await self._stop_engine()
            await asyncio.sleep(0.1)

    async def _start_engine(self) -> None:
        await self.k.create_pod("qwen-0", "qwen", ready=False)
        self.engine = await asyncio.to_thread(start_server, self.model_dir, self.workdir, "--served-model-name",
                                              "tiny", *self.mounts())
        self.started.append(time.monotonic())
        self.backends.write_text(self.engine.base_url + "\n")
        await self.k.set_ready("qwen-0", True)
        await self.k.roll_out("qwen")

    async def _stop_engine(self) -> None:
        # The endpoint goes first, then the pod drains (SIGTERM), as a terminating pod does.
        self.backends.write_text("")
        await self.k.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/qwen-0")
        await asyncio.to_thread(self.engine.stop)
        self.engine = None
        await self.k.roll_out("qwen")

    def metrics_url(self, pod: dict[str, Any]) -> str | None:
        server = self.router if pod["metadata"]["name"].startswith("qwen-router") else self.engine
        return None if server is None else f"{server.base_url}/metrics"

    def _object(self, plural: str, name: str) -> dict[str, Any]:
        found = self.k.object(f"v1/{plural}", name)
        assert found is not None, f"{plural}/{name} was not rendered"
        return found


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
                await kubelet.start_router()
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
