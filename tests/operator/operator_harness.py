"""The real kopf operator against an emulated API server, with bounded waits throughout.

A test writes a coroutine and hands it to `run()`; inside, `Cluster` plays kubectl and the
Deployment controller, and `operator()` runs kvpilot's handlers until the block ends.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import os
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import kmock
import kopf
import yaml

from crd_validation import errors, with_defaults
from emulated_apiserver import EmulatedApiServer
from kvpilot.operator import handlers, kube, naming, reconcile

T = TypeVar("T")
NAMESPACE = "ml"
ENGINES = "kvpilot.dev/v1alpha1/inferenceengines"
# The User-Agent of the requests the tests make (as kubectl or a controller), to tell them apart
# from the operator's.
TEST_CLIENT = "kvpilot-tests"
SCENARIO_TIMEOUT = 60
WAIT_TIMEOUT = 15


# An engine with one keyed tenant, and the children the operator makes for it.
SPEC: dict[str, Any] = {
    "model": {"name": "qwen", "huggingFace": {"repo": "Qwen/Qwen2.5-0.5B-Instruct"}},
    "image": "ghcr.io/kvpilot/kvpilot:0.1.0",
    "replicas": 2,
    "scheduling": {"tenants": [{"name": "prod", "priority": 10, "apiKeySecretRef": {"name": "prod-key"}}]},
    # The engine alone; test_operator_routing.py runs it with its routers.
    "routing": {"enabled": False},
}
CHILDREN = {
    "Deployment": "apps/v1/deployments",
    "Service": "v1/services",
    "ConfigMap": "v1/configmaps",
    "Secret": "v1/secrets",
    "PodDisruptionBudget": "policy/v1/poddisruptionbudgets",
    "ServiceMonitor": "monitoring.coreos.com/v1/servicemonitors",
    "AdminToken": "v1/secrets",
    "SchedulingConfig": "v1/configmaps",
}
# What runs an engine over several pods in place of the Deployment, where the cluster serves it.
LEADER_WORKER_SETS = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
# The kinds only routing adds (its Deployment, Service, PDB and Secret are of the kinds above).
ROUTER_KINDS = {
    "ServiceAccount": "v1/serviceaccounts",
    "Role": "rbac.authorization.k8s.io/v1/roles",
    "RoleBinding": "rbac.authorization.k8s.io/v1/rolebindings",
}
CHILD_NAMES = {"ConfigMap": "qwen-config", "Secret": "qwen-tenant-keys", "AdminToken": "qwen-admin-token",
               "SchedulingConfig": "qwen-scheduling"}


def key(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def child(k: Cluster, kind: str) -> dict[str, Any] | None:
    return k.object(CHILDREN[kind], CHILD_NAMES.get(kind, "qwen"))


def condition(engine: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in engine.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def phase_is(k: Cluster, phase: str, generation: int) -> bool:
    status = k.engine("qwen").get("status", {})
    return status.get("phase") == phase and status.get("observedGeneration") == generation


def tenants_file(k: Cluster) -> list[dict[str, Any]]:
    config = child(k, "ConfigMap")
    assert config is not None
    return yaml.safe_load(config["data"]["tenants.yaml"])


async def created(k: Cluster, spec: dict[str, Any] = SPEC) -> dict[str, Any]:
    await k.create_secret("prod-key", {"api-key": key("sk-prod")})
    await k.create_engine("qwen", spec)
    return await eventually(lambda: k.deployment("qwen"), "the Deployment")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for an endpoint the test starts."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(scenario: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(scenario, SCENARIO_TIMEOUT))


async def eventually(probe: Callable[[], Any], what: str, timeout: float = WAIT_TIMEOUT) -> Any:
    """Poll `probe` until it returns something truthy; fail, saying what was awaited, at the timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = probe()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


class Cluster:
    """What a test does to the cluster, as kubectl or a controller would."""

    def __init__(self, server: EmulatedApiServer, session: aiohttp.ClientSession, url: str) -> None:
        self.server = server
        self.session = session
        self.url = url

    def object(self, resource: str, name: str, namespace: str = NAMESPACE) -> dict[str, Any] | None:
        address = (kmock.resource(resource), namespace, name)
        if address not in self.server.objects or self.server.objects[address].deleted:
            return None
        return copy.deepcopy(self.server.objects[address].raw)

    def engine(self, name: str) -> dict[str, Any]:
        found = self.object(ENGINES, name)
        assert found is not None, f"InferenceEngine {name} does not exist"
        return found

    def deployment(self, name: str) -> dict[str, Any] | None:
        return self.object(CHILDREN["Deployment"], name)

    def events(self, reason: str | None = None) -> list[dict[str, Any]]:
        while True:
            try:
                found = [obj.raw for key, obj in self.server.objects.items()
                         if key[0] == "v1/events" and not obj.deleted]
                break
            except RuntimeError:  # the emulator's thread stored an object meanwhile: read again
                continue
        return [event for event in found if reason is None or event.get("reason") == reason]

    async def create_engine(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        engine = with_defaults({
            "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceEngine",
            "metadata": {"name": name, "namespace": NAMESPACE}, "spec": copy.deepcopy(spec),
        })
        assert errors(engine) == []
        return await self._send("POST", f"/apis/kvpilot.dev/v1alpha1/namespaces/{NAMESPACE}/inferenceengines", engine)

    async def update_engine(self, name: str, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Change the spec as `kubectl edit` would; the server defaults and validates it."""
        engine = self.engine(name)
        spec = copy.deepcopy(engine["spec"])
        change(spec)
        engine = with_defaults({**engine, "spec": spec})
        assert errors({key: value for key, value in engine.items() if key != "status"}) == []
        return await self._send(
            "PATCH", f"/apis/kvpilot.dev/v1alpha1/namespaces/{NAMESPACE}/inferenceengines/{name}",
            [{"op": "replace", "path": "/spec", "value": engine["spec"]}], "application/json-patch+json",
        )

    async def create_pod(self, name: str, engine: str, *, ready: bool, router: bool = False,
                         worker: bool = False) -> None:
        """A pod of the engine's Deployment (or its routers', or a worker of its LeaderWorkerSet's
        groups), as its controller and the kubelet would make it."""
        labels = (naming.router_selector_labels(engine) if router else naming.worker_labels(engine) if worker
                  else naming.selector_labels(engine))
        await self._send("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
            "status": _pod_status(ready),
        })

    async def set_ready(self, pod: str, ready: bool) -> None:
        await self._send("PATCH", f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}/status",
                         {"status": _pod_status(ready)}, "application/merge-patch+json")

    async def scale(self, name: str, replicas: int) -> None:
        """`kubectl scale ie NAME --replicas=N`, or an HPA's write: the scale subresource."""
        await self._send(
            "PATCH", f"/apis/kvpilot.dev/v1alpha1/namespaces/{NAMESPACE}/inferenceengines/{name}/scale",
            {"spec": {"replicas": replicas}}, "application/merge-patch+json",
        )

    async def create_secret(self, name: str, data: dict[str, str]) -> None:
        await self._send("POST", f"/api/v1/namespaces/{NAMESPACE}/secrets", {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NAMESPACE}, "data": data,
        })

    async def delete(self, url: str) -> None:
        await self._send("DELETE", url)

    async def patch(self, url: str, change: dict[str, Any]) -> None:
        """`kubectl patch --type=merge`: someone editing an object by hand."""
        await self._send("PATCH", url, change, "application/merge-patch+json")

    async def roll_out(self, name: str, *, updated: int | None = None, available: int | None = None) -> None:
        """Report the Deployment's rollout as its controller would: it has observed the current
        generation, `updated` pods run the current template, `available` of them serve."""
        deployment = self.deployment(name)
        assert deployment is not None
        wanted = deployment["spec"]["replicas"]
        updated = wanted if updated is None else updated
        available = updated if available is None else available
        complete = updated == wanted and available == wanted
        await self._send(
            "PATCH", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}/status",
            {"status": {
                "observedGeneration": deployment["metadata"]["generation"],
                "replicas": max(wanted, updated), "updatedReplicas": updated,
                "readyReplicas": available, "availableReplicas": available,
                "conditions": [
                    {"type": "Available", "status": "True" if available else "False",
                     "reason": "MinimumReplicasAvailable"},
                    {"type": "Progressing", "status": "True",
                     "reason": "NewReplicaSetAvailable" if complete else "ReplicaSetUpdated"},
                ],
            }},
            "application/merge-patch+json",
        )

    def leader_worker_set(self, engine: str) -> dict[str, Any] | None:
        return self.object(LEADER_WORKER_SETS, naming.leader_worker_set_name(engine))

    async def report_groups(self, engine: str, *, ready: int | None = None) -> None:
        """Report the engine's LeaderWorkerSet as its controller would: it has observed the current
        generation, every group runs the current templates, `ready` of them (all by default) are ready."""
        lws = self.leader_worker_set(engine)
        assert lws is not None
        wanted = lws["spec"]["replicas"]
        ready = wanted if ready is None else ready
        await self._send(
            "PATCH", f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NAMESPACE}/leaderworkersets/"
                     f"{lws['metadata']['name']}/status",
            {"status": {"observedGeneration": lws["metadata"]["generation"], "replicas": wanted,
                        "updatedReplicas": wanted, "readyReplicas": ready,
                        "hpaPodSelector": f"leaderworkerset.sigs.k8s.io/name={lws['metadata']['name']},"
                                          "leaderworkerset.sigs.k8s.io/worker-index=0",
                        "conditions": [{"type": "Available" if ready == wanted else "Progressing",
                                        "status": "True", "reason": "AllGroupsReady" if ready == wanted
                                        else "GroupsProgressing", "message": "", "lastTransitionTime":
                                        "2026-01-01T00:00:00Z"}]}},
            "application/merge-patch+json",
        )

    async def _send(self, method: str, url: str, body: Any = None, content_type: str = "application/json") -> Any:
        async with self.session.request(method, url, json=body, headers={"Content-Type": content_type}) as response:
            payload = await response.json()
            assert response.status < 400, payload
            return payload


def _pod_status(ready: bool) -> dict[str, Any]:
    return {"phase": "Running", "podIP": "10.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}


@contextlib.asynccontextmanager
async def cluster(tmp_path: Path, *, service_monitors: bool = False,
                  leader_worker_sets: bool = False) -> AsyncIterator[Cluster]:
    """An emulated API server on its own thread and event loop: kopf, when it stops, waits for
    every task started in its loop since it began, and the server's watch streams never end.
    `service_monitors`, `leader_worker_sets`: whether it serves those kinds (their CRDs installed)."""
    server = _ServerThread(service_monitors=service_monitors, leader_worker_sets=leader_worker_sets)
    server.start()
    await asyncio.to_thread(server.started.wait, WAIT_TIMEOUT)
    assert server.url, "the emulated API server did not start"
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", server.url)
    previous = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(kubeconfig)
    try:
        async with aiohttp.ClientSession(base_url=server.url, headers={"User-Agent": TEST_CLIENT}) as session:
            yield Cluster(server.api, session, server.url)
    finally:
        if previous is None:
            del os.environ["KUBECONFIG"]
        else:
            os.environ["KUBECONFIG"] = previous
        server.stop()
        await asyncio.to_thread(server.join, WAIT_TIMEOUT)


def write_kubeconfig(path: Path, url: str, token: str | None = None) -> Path:
    """A kubeconfig for the emulated API server; a `token` tells this client's requests apart."""
    user = f"{{token: {token}}}" if token else "{}"
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: emulated, cluster: {{server: '{url}'}}}}]\n"
        f"users: [{{name: tester, user: {user}}}]\n"
        "contexts: [{name: test, context: {cluster: emulated, user: tester}}]\n"
        "current-context: test\n"
    )
    return path


class _ServerThread(threading.Thread):
    def __init__(self, *, service_monitors: bool, leader_worker_sets: bool) -> None:
        super().__init__(name="emulated-apiserver", daemon=True)
        self.service_monitors = service_monitors
        self.leader_worker_sets = leader_worker_sets
        self.started = threading.Event()
        self.url = ""
        self.api = EmulatedApiServer()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None

    def run(self) -> None:
        asyncio.run(self._serve())

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        async with self.api, kmock.Server(self.api) as http:
            _declare_resources(self.api, service_monitors=self.service_monitors,
                               leader_worker_sets=self.leader_worker_sets)
            self.url = str(http.url)
            self.started.set()
            await self._stopping.wait()


@contextlib.asynccontextmanager
async def reconciler_alone(**options: Any) -> AsyncIterator[reconcile.Reconciler]:
    """The operator's Reconciler without kopf (made with `options`), for a test that calls it itself."""
    with posted_events():
        reconciler = reconcile.Reconciler(kube.Kube(kopf.OperatorSettings()), **options)
        try:
            yield reconciler
        finally:
            await reconciler.client.close()


@contextlib.contextmanager
def posted_events() -> Iterator[list[Any]]:
    """kopf's event posting, as an operator sets it up, for operator code that a test calls
    directly: each Event that code posts is appended to the list this yields."""
    from kopf._core.engines import posting  # kopf keeps the posting queue in context variables

    events: list[Any] = []

    class _Queue:
        def put_nowait(self, event: Any) -> None:
            events.append(event)

    tokens = [
        (posting.settings_var, posting.settings_var.set(kopf.OperatorSettings())),
        (posting.event_queue_var, posting.event_queue_var.set(_Queue())),  # type: ignore[arg-type]
        (posting.event_queue_loop_var, posting.event_queue_loop_var.set(asyncio.get_running_loop())),
    ]
    try:
        yield events
    finally:
        for variable, token in reversed(tokens):
            variable.reset(token)


@contextlib.asynccontextmanager
async def operator(**memo: Any) -> AsyncIterator[None]:
    """`memo` reaches the operator's startup handler (e.g. pod_metrics_url, for fake pod pages)."""
    stop: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    settings = kopf.OperatorSettings()
    # Idle workers would otherwise linger for seconds when the operator stops.
    settings.queueing.idle_timeout = 0.2
    settings.queueing.exit_timeout = 0.5
    task = asyncio.create_task(kopf.operator(
        registry=handlers.registry,
        settings=settings,
        standalone=True,
        namespaces=[NAMESPACE],
        stop_flag=stop,
        ready_flag=ready,
        memo=kopf.Memo(memo),
    ))
    try:
        await asyncio.wait_for(asyncio.shield(ready), WAIT_TIMEOUT)
        yield
    finally:
        stop.set_result(None)
        await asyncio.wait_for(task, WAIT_TIMEOUT)


def _declare_resources(server: EmulatedApiServer, *, service_monitors: bool, leader_worker_sets: bool) -> None:
    """The discovery documents of a cluster: built-in kinds, the CRD, and maybe ServiceMonitors
    and LeaderWorkerSets."""
    verbs = {"get", "list", "watch", "create", "patch", "update", "delete"}
    declared = {
        ENGINES: ("InferenceEngine", {"status", "scale"}),
        CHILDREN["Deployment"]: ("Deployment", {"status", "scale"}),
        CHILDREN["PodDisruptionBudget"]: ("PodDisruptionBudget", {"status"}),
        CHILDREN["Service"]: ("Service", {"status"}),
        CHILDREN["ConfigMap"]: ("ConfigMap", set()),
        CHILDREN["Secret"]: ("Secret", set()),
        **{resource: (kind, set()) for kind, resource in ROUTER_KINDS.items()},
        "v1/pods": ("Pod", {"status"}),
        "v1/events": ("Event", set()),
        "coordination.k8s.io/v1/leases": ("Lease", set()),
    }
    if service_monitors:
        declared[CHILDREN["ServiceMonitor"]] = ("ServiceMonitor", set())
    if leader_worker_sets:
        declared[LEADER_WORKER_SETS] = ("LeaderWorkerSet", {"status", "scale"})
    for resource, (kind, subresources) in declared.items():
        server.resources[resource] = kmock.ResourceInfo(
            kind=kind, namespaced=True, verbs=verbs, subresources=subresources
        )
    server.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False, verbs=verbs)
