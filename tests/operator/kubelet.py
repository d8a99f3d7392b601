"""A stand-in for the Deployment controller and the kubelet of the engine `qwen` (operator_harness's
SPEC, with routing): real `kvpilot serve` and `kvpilot router` processes (the tiny model), started
on what the pods would mount (the tenants file and its keys, the cache salt), laid out from the
objects the operator rendered. The router learns of the replica through a backends file, where a
cluster's EndpointSlices would (the router's EndpointSlice watch has its own tests).
"""

from __future__ import annotations

import asyncio
import base64
import sys
import time
from pathlib import Path
from typing import Any

from operator_harness import NAMESPACE, Cluster
from kvpilot.operator import pod_parts

sys.path.insert(0, str(Path(__file__).parents[1] / "runtime" / "server"))  # the real-server harness
from server_harness import ServerProcess, start_server  # noqa: E402


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

    async def start_router(self, hold_timeout: float) -> None:
        self.router = await asyncio.to_thread(
            start_server, self.model_dir, self.workdir, "--backends-file", str(self.backends), "--hold-timeout",
            str(hold_timeout), *self.mounts(), subcommand="router")
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
