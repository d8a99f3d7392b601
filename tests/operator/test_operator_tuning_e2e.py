"""The policy tuner end to end: the operator's reconciler and tuning shell against an emulated API
server, and two real `kvpilot serve` processes as the engine's pods.

The test plays the kubelet: it lays out what the pods mount (the admin token, the scheduling
policy file, the tenants file and its keys) from the objects the operator rendered, and starts
the servers on them. The control loop's intervals run one at a time (`ControlLoops.tick`: list
the pods, scrape their /metrics, run the autoscaler and the tuner), on a clock the test advances.
"""

from __future__ import annotations

import asyncio
import base64
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import kopf
import pytest

from operator_harness import NAMESPACE, Cluster, cluster, key, posted_events
from kvpilot.operator import control, engine_admin, kube, reconcile, render, status

sys.path.insert(0, str(Path(__file__).parents[1] / "runtime" / "server"))  # the real-server harness
from server_harness import HTTP_TIMEOUT_S, ServerProcess, start_server, sum_samples, wait_until  # noqa: E402

pytestmark = pytest.mark.timeout(400)

INTERVAL = 15.0
SPEC: dict[str, Any] = {
    "model": {"name": "tiny", "hostPath": "/models/tiny"},
    "image": "ghcr.io/kvpilot/kvpilot:0.1.0",
    "replicas": 2,
    "scheduling": {
        "policy": "auto",
        "tenants": [
            {"name": "gold", "priority": 100, "apiKeySecretRef": {"name": "gold-key"}},
            {"name": "bronze", "priority": 0, "apiKeySecretRef": {"name": "bronze-key"}},
        ],
    },
    # At maxReplicas: the engine cannot scale further.
    "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2, "targetQueueDepth": 1},
}
KEYS = {"gold": "sk-gold", "bronze": "sk-bronze"}
PODS = ("tiny-0", "tiny-1")
QUEUED = ("bronze", "bronze", "gold", "gold")  # the order in which they arrive at each server
MAX_TOKENS = 3


class Pods:
    """The pod volumes, laid out from the rendered objects, and the servers running on them."""

    def __init__(self, k: Cluster, workdir: Path, model_dir: Path) -> None:
        self.k, self.workdir, self.model_dir = k, workdir, model_dir
        self.servers: dict[str, ServerProcess] = {}

    def mount(self, pod: str) -> list[str]:
        root = self.workdir / pod
        keys_dir = root / "tenant-keys"
        keys_dir.mkdir(parents=True, exist_ok=True)
        for name, value in self._object("secrets", "tiny-tenant-keys")["data"].items():
            (keys_dir / name).write_bytes(base64.b64decode(value))
        tenants = self._object("configmaps", "tiny-config")["data"]["tenants.yaml"]
        (root / "tenants.yaml").write_text(tenants.replace(render.TENANT_KEYS_DIR, str(keys_dir)))
        token = self._object("secrets", "tiny-admin-token")["data"][render.ADMIN_TOKEN_KEY]
        (root / "token").write_bytes(base64.b64decode(token))
        (root / "policy").write_text(self._object("configmaps", "tiny-scheduling")["data"]["policy"])
        return ["--tenants-file", str(root / "tenants.yaml"), "--admin-token-file", str(root / "token"),
                "--scheduling-policy-file", str(root / "policy")]

    async def start(self, pod: str) -> ServerProcess:
        # One sequence at a time: queued requests then start in an order the test can observe.
        args = [*self.mount(pod), "--served-model-name", "tiny", "--max-num-seqs", "1"]
        self.servers[pod] = await asyncio.to_thread(start_server, self.model_dir, self.workdir, *args)
        return self.servers[pod]

    def url(self, pod: dict[str, Any]) -> str | None:
        server = self.servers.get(pod["metadata"]["name"])
        return server.base_url if server is not None else None

    def metrics_url(self, pod: dict[str, Any]) -> str | None:
        base = self.url(pod)
        return None if base is None else f"{base}/metrics"

    def policy(self, pod: str) -> str:
        samples = self.servers[pod].metrics()
        (running,) = [p for p in ("fcfs", "priority")
                      if sum_samples(samples, "kvpilot:scheduling_policy_info", policy=p) == 1]
        return running

    def _object(self, plural: str, name: str) -> dict[str, Any]:
        found = self.k.object(f"v1/{plural}", name)
        assert found is not None, f"{plural}/{name} was not rendered"
        return found


class Loop:
    """The operator's control loop, one interval at a time, on the test's clock."""

    def __init__(self, k: Cluster, reconciler: reconcile.Reconciler, pods: Pods) -> None:
        self.k, self.now = k, time.time()
        self.loops = control.ControlLoops(reconciler, pod_metrics_url=pods.metrics_url, pod_url=pods.url,
                                          clock=lambda: self.now)

    async def interval(self, seconds_later: float = INTERVAL) -> str:
        """One interval, `seconds_later` than the last; the effective policy after it."""
        self.now += seconds_later
        assert await self.loops.tick(NAMESPACE, "tiny") == INTERVAL
        return self.k.engine("tiny")["status"]["effectiveSchedulingPolicy"]


def tenant(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


async def queue_behind_a_blocker(server: ServerProcess, client: httpx.AsyncClient, finished: list[tuple[int, str]]):
    """A long stream holds the server's one slot; QUEUED then wait behind it. Returns the stream
    (closing it aborts the blocker), its line iterator (which must stay referenced: dropped, it
    closes the stream) and the tasks of the queued requests."""
    blocker = client.stream("POST", f"{server.base_url}/v1/completions", headers=tenant("bronze"),
                            json={"model": "tiny", "prompt": "blocker", "max_tokens": 2000, "ignore_eos": True,
                                  "stream": True})
    stream = await blocker.__aenter__()
    assert stream.status_code == 200
    lines = stream.aiter_lines()
    while not (await anext(lines)).startswith("data: "):
        pass  # until the blocker runs

    async def one(index: int, name: str) -> dict[str, Any]:
        response = await client.post(f"{server.base_url}/v1/completions", headers=tenant(name), json={
            "model": "tiny", "prompt": f"request {index}", "max_tokens": MAX_TOKENS, "ignore_eos": True})
        assert response.status_code == 200, response.text
        finished.append((index, name))
        return response.json()

    tasks = []
    for index, name in enumerate(QUEUED):
        tasks.append(asyncio.create_task(one(index, name)))
        await asyncio.to_thread(wait_until, lambda n=index + 1: server.metric("vllm:num_requests_waiting") == n,
                                60.0, 0.05, f"{index + 1} waiting requests")
    return blocker, lines, tasks


def test_sustained_queue_at_max_replicas_switches_every_pod_and_calm_switches_back(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k:
            with posted_events() as events:
                client = kube.Kube(kopf.OperatorSettings())
                reconciler = reconcile.Reconciler(client)
                pods = Pods(k, tmp_path, tiny_llama_dir)
                loop = Loop(k, reconciler, pods)
                try:
                    await drive(k, reconciler, pods, loop, events)
                finally:
                    for server in pods.servers.values():
                        await asyncio.to_thread(server.stop)
                    await loop.loops.close()
                    await client.close()

    asyncio.run(asyncio.wait_for(scenario(), 360))


async def drive(k: Cluster, reconciler: reconcile.Reconciler, pods: Pods, loop: Loop, events: list[Any]) -> None:
    for name, value in KEYS.items():
        await k.create_secret(f"{name}-key", {"api-key": key(value)})
    await k.create_engine("tiny", SPEC)
    await reconciler.reconcile(k.engine("tiny"))
    token = base64.b64decode(k.object("v1/secrets", "tiny-admin-token")["data"]["token"]).decode()
    for pod in PODS:
        await pods.start(pod)
        await k.create_pod(pod, "tiny", ready=True)
    assert {pods.policy(pod) for pod in PODS} == {"fcfs"}

    # A wrong or missing token is refused, and changes nothing.
    (wrong,) = await engine_admin.apply_policy({"tiny-0": pods.servers["tiny-0"].base_url}, "priority", "not-it",
                                               timeout=5)
    assert (wrong.outcome, wrong.detail.split(":")[0]) == ("failed", "POST /admin/scheduling answered 401")
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http:
        missing = await http.post(f"{pods.servers['tiny-0'].base_url}/admin/scheduling", json={"policy": "priority"})
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_admin_token"
    assert pods.policy("tiny-0") == "fcfs"

    finished: dict[str, list[tuple[int, str]]] = {pod: [] for pod in PODS}
    before = {pod: pods.servers[pod].metric("vllm:request_success_total", finished_reason="length") for pod in PODS}
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as http:
        queued = {pod: await queue_behind_a_blocker(pods.servers[pod], http, finished[pod]) for pod in PODS}

        # tiny-1 is not ready at the switch: it is left for the next interval.
        await k.set_ready("tiny-1", False)
        assert await loop.interval() == "fcfs"  # pressure, 1st interval
        assert await loop.interval() == "priority"
        # At maxReplicas, the autoscaler could not help: it says so.
        limited = status.condition(k.engine("tiny"), "ScalingLimited")
        assert (limited["status"], k.engine("tiny")["spec"]["replicas"]) == ("True", 2)
        assert k.engine("tiny")["status"]["effectiveSchedulingPolicy"] == "priority"
        assert k.object("v1/configmaps", "tiny-scheduling")["data"] == {"policy": "priority"}
        (changed,) = [e for e in events if e.reason == "SchedulingPolicyChanged"]
        assert changed.message.startswith("fcfs -> priority: 4 waiting requests per replica (target 1)")
        assert (pods.policy("tiny-0"), pods.policy("tiny-1")) == ("priority", "fcfs")
        await k.set_ready("tiny-1", True)
        assert await loop.interval() == "priority"
        assert {pods.policy(pod) for pod in PODS} == {"priority"}

        # The blockers go: what waited under fcfs now runs gold first, each request exactly once.
        for pod in PODS:
            blocker, _, tasks = queued[pod]
            await blocker.__aexit__(None, None, None)
            answers = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            assert [name for _, name in finished[pod]] == ["gold", "gold", "bronze", "bronze"], pod
            assert sorted(index for index, _ in finished[pod]) == list(range(len(QUEUED)))
            assert len({answer["id"] for answer in answers}) == len(QUEUED)
            assert all(answer["usage"]["completion_tokens"] == MAX_TOKENS for answer in answers)
    for pod in PODS:
        server = pods.servers[pod]
        assert server.metric("vllm:request_success_total", finished_reason="length") - before[pod] == len(QUEUED)
        # The blocker, aborted when its stream closed; nothing else was aborted.
        await asyncio.to_thread(wait_until, lambda s=server: s.metric("vllm:request_success_total",
                                                                      finished_reason="abort") == 1,
                                30.0, 0.05, "the blocker's abort")

    # tiny-1 restarts while the engine runs priority: it starts with priority, from the ConfigMap.
    await k.set_ready("tiny-1", False)
    await asyncio.to_thread(pods.servers["tiny-1"].stop)
    await pods.start("tiny-1")
    assert pods.policy("tiny-1") == "priority"
    await k.set_ready("tiny-1", True)

    # Calm: the queue stays at 0 for the calm window (300 s by default), then fcfs everywhere.
    assert await loop.interval() == "priority"  # the first calm interval
    assert await loop.interval(299) == "priority"
    assert await loop.interval(1) == "fcfs"
    assert {pods.policy(pod) for pod in PODS} == {"fcfs"}
    assert k.engine("tiny")["status"]["effectiveSchedulingPolicy"] == "fcfs"
    assert k.object("v1/configmaps", "tiny-scheduling")["data"] == {"policy": "fcfs"}
    assert [e.message.split(":")[0] for e in events if e.reason == "SchedulingPolicyChanged"] == [
        "fcfs -> priority", "priority -> fcfs"]
    # The reconciler keeps the admin token: the pods' token files stay valid.
    await reconciler.reconcile(k.engine("tiny"))
    assert base64.b64decode(k.object("v1/secrets", "tiny-admin-token")["data"]["token"]).decode() == token
    assert k.object("v1/configmaps", "tiny-scheduling")["data"] == {"policy": "fcfs"}
