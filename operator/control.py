"""The control loop: every intervalSeconds, for each engine that some controller wants, list its
pods, read the ready ones' metrics once, and hand that same reading to each controller.

`ControlLoops.controllers` are what runs on each reading: the autoscaler (below), for engines
with autoscaling enabled, the scheduling-policy tuner (tuning.py), for `scheduling.policy: auto`,
and the LoRA adapters' loader (adapter_loading.py), for engines with spec.adapters; each has the
same `Controller` shape (controller.py). The autoscaler goes first: the tuner judges whether the
engine can still scale from the replicas the interval began with. What the controllers record
(their status fields, conditions and parts of status.controlMemory) goes in one status write per
interval; what each does after it is recorded comes next.

One asyncio task per engine, started and stopped from the engines' watch events: no kopf daemon
or timer, so no finalizer on the InferenceEngines (deletion still relies on ownerReferences
alone). A failing interval is logged and the loop goes on; nothing the pods or Prometheus answer
can end it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import datetime
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import aiohttp
import kopf

from kvpilot.operator import (adapter_loading, autoscaler, control_memory, kube, metrics, naming, reconcile,
                              render_lws, render_router, samples, status, tuning)
from kvpilot.operator.controller import Controller, Interval, Key, StatusChange, Step

logger = logging.getLogger(__name__)

# The pod-deletion-cost of the pods a scale-down removes; others carry none, which counts as 0.
REMOVE_FIRST = "-1000"


def pod_states(pods: Sequence[Mapping[str, Any]]) -> tuple[list[Mapping[str, Any]], int]:
    """The ready pods, and the count of those still starting; terminating and finished pods are
    neither (they are on their way out)."""
    ready: list[Mapping[str, Any]] = []
    starting = 0
    for pod in pods:
        pod_status = pod.get("status") or {}
        if pod["metadata"].get("deletionTimestamp") or pod_status.get("phase") in ("Succeeded", "Failed"):
            continue
        conditions = pod_status.get("conditions") or []
        if any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
            ready.append(pod)
        else:
            starting += 1
    return ready, starting


def merged(changes: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The controllers' status changes as one: their fields side by side, controlMemory's parts too."""
    status: dict[str, Any] = {}
    for change in changes:
        for field, value in change.items():
            if field == control_memory.FIELD:
                status[field] = {**status.get(field, {}), **value}
            else:
                status[field] = value
    return status


def recorded_in_turn(records: Sequence[StatusChange], fresh: Mapping[str, Any]) -> dict[str, Any]:
    """The controllers' status changes as one write, each made on the status as the ones before it
    left it: two that set conditions both keep theirs."""
    changes = []
    for record in records:
        change = record(fresh)
        changes.append(change)
        fresh = {**fresh, "status": merged([fresh.get("status") or {}, change])}
    return merged(changes)


def retired(status: Mapping[str, Any] | None, off: Sequence[Controller]) -> dict[str, Any] | None:
    """The status merge patch that removes what the controllers turned off kept there: their parts
    of the memory, their fields and their conditions; None where status holds none of it."""
    status = status or {}
    patch = control_memory.forgotten(status, [c.memory for c in off]) or {}
    patch.update({field: None for c in off for field in c.status_fields if field in status})
    types = {kind for c in off for kind in c.condition_types}
    conditions = status.get("conditions") or []
    if any(condition.get("type") in types for condition in conditions):
        patch["conditions"] = [condition for condition in conditions if condition.get("type") not in types]
    return patch or None


class ControlLoops:
    def __init__(
        self,
        reconciler: reconcile.Reconciler,
        *,
        pod_metrics_url: Callable[[Mapping[str, Any]], str | None] = metrics.pod_metrics_url,
        pod_url: Callable[[Mapping[str, Any]], str | None] = metrics.pod_url,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._reconciler = reconciler
        self._client = reconciler.client
        self._pod_metrics_url = pod_metrics_url
        # Tests advance time themselves, e.g. through a calm window of minutes.
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._tasks: dict[Key, asyncio.Task[None]] = {}
        self.controllers: list[Controller] = [Autoscaling(reconciler), tuning.PolicyTuning(reconciler, pod_url=pod_url),
                                              adapter_loading.AdapterLoading(reconciler, pod_url=pod_url)]

    def follow(self, engine: Mapping[str, Any], *, deleted: bool) -> None:
        """Start or stop the engine's loop after a watch event. Called from a kopf handler, so
        the task inherits the context in which kopf posts events."""
        key = (engine["metadata"]["namespace"], engine["metadata"]["name"])
        wanted = not deleted and self._wanted(engine)
        task = self._tasks.get(key)
        if wanted and (task is None or task.cancelling()):
            self._tasks[key] = asyncio.create_task(self._run(key), name=f"control {key[0]}/{key[1]}")
        elif not wanted and task is not None:
            task.cancel()

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def tick(self, namespace: str, name: str) -> float | None:
        """One interval for one engine. Returns the seconds until the next, or None when no
        controller wants the engine any more."""
        engine = await self._client.get(kube.path(naming.API_VERSION, naming.KIND, namespace, name))
        if engine is None or engine["metadata"].get("deletionTimestamp"):
            return None
        await self._forget_unwanted(engine)
        if not self._wanted(engine):
            return None
        spec = engine["spec"]
        seconds = spec["autoscaling"]["intervalSeconds"]
        pods = await self._client.list("v1", "Pod", namespace, selector=naming.selector_string(name))
        ready, starting = pod_states(pods)
        source = await self._source(engine, seconds)
        if isinstance(source, samples.Problem):
            reading, held = samples.Reading(failure=source), source
        else:
            reading = await source.read(namespace, ready, self._clock(),
                                        latencies=bool(spec["autoscaling"].get("targets")))
            held = await self._held(engine, source)
        interval = Interval(engine, ready, starting, reading, self._clock(), held)
        steps = [await controller.step(interval) for controller in self.controllers if controller.wants(spec)]

        async def recorded(fresh: Mapping[str, Any]) -> dict[str, Any]:
            return recorded_in_turn([step.record for step in steps], fresh)

        await self._reconciler.update_status(namespace, name, recorded)
        for step in steps:
            if step.then is not None:
                await step.then()
        return seconds

    async def _forget_unwanted(self, engine: Mapping[str, Any]) -> None:
        """Controllers turned off forget the engine, here and in status: turned on again, they
        start afresh."""
        key = (engine["metadata"]["namespace"], engine["metadata"]["name"])
        off = [controller for controller in self.controllers if not controller.wants(engine["spec"])]
        for controller in off:
            controller.forget(key)
        if retired(engine.get("status"), off) is None:
            return

        async def gone(fresh: Mapping[str, Any]) -> dict[str, Any]:
            return retired(fresh.get("status"), off) or {}

        await self._reconciler.update_status(*key, gone)

    def _wanted(self, engine: Mapping[str, Any]) -> bool:
        return any(controller.wants(engine["spec"]) for controller in self.controllers)

    async def _run(self, key: Key) -> None:
        seconds: float | None = 1.0  # until a tick has read the engine's interval
        try:
            while seconds is not None:
                started = asyncio.get_running_loop().time()
                try:
                    seconds = await self.tick(*key)
                except kube.ApiError as error:
                    logger.warning(f"InferenceEngine {key[0]}/{key[1]}: this interval failed: {error}")
                except Exception:
                    # A bug must not end the loop of this engine, or of any other.
                    logger.exception(f"InferenceEngine {key[0]}/{key[1]}: this interval failed")
                if seconds is not None:
                    await asyncio.sleep(max(0.0, started + seconds - asyncio.get_running_loop().time()))
        finally:
            # A loop cancelled and restarted at once has a successor, which keeps its place.
            if self._tasks.get(key) is asyncio.current_task():
                del self._tasks[key]
                for controller in self.controllers:
                    controller.forget(key)

    async def _source(self, engine: Mapping[str, Any], seconds: float) -> metrics.MetricsSource | samples.Problem:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        timeout = metrics.request_timeout(seconds)
        prometheus = engine["spec"]["autoscaling"].get("prometheus")
        if prometheus is None:
            return metrics.DirectScrape(self._session, timeout=timeout, url_of=self._pod_metrics_url)
        token = await self._bearer_token(engine["metadata"]["namespace"], prometheus)
        if isinstance(token, samples.Problem):
            return token
        return metrics.Prometheus(self._session, prometheus["url"], timeout=timeout, bearer_token=token)

    async def _held(self, engine: Mapping[str, Any], source: metrics.MetricsSource) -> float | samples.Problem | None:
        """What the engine's ready routers hold; None for an engine without routers."""
        if not render_router.routed(engine):
            return None
        namespace, name = engine["metadata"]["namespace"], engine["metadata"]["name"]
        routers = await self._client.list("v1", "Pod", namespace, selector=naming.router_selector_string(name))
        ready, _ = pod_states(routers)
        return await source.read_held(namespace, ready)

    async def _bearer_token(self, namespace: str, prometheus: Mapping[str, Any]) -> str | samples.Problem | None:
        ref = prometheus.get("bearerTokenSecretRef")
        if ref is None:
            return None
        secret = await self._client.get(kube.path("v1", "Secret", namespace, ref["name"]))
        encoded = (secret or {}).get("data", {}).get(ref["key"])
        if encoded is None:
            what = "does not exist" if secret is None else f"has no key {ref['key']}"
            return samples.Problem(samples.UNREACHABLE, f"the Prometheus token's Secret {ref['name']} {what}")
        try:
            return base64.b64decode(encoded, validate=True).decode().strip()
        except (binascii.Error, UnicodeDecodeError):
            return samples.Problem(samples.UNREACHABLE, f"Secret {ref['name']} key {ref['key']} is not a token")


class Autoscaling:
    """The autoscaler's controller: decide, write spec.replicas through the scale subresource,
    post an Event per change, and record the reading and the conditions in status."""

    memory = control_memory.AUTOSCALER
    # Its fields and conditions stay as the record of its last decision once it is turned off.
    status_fields: tuple[str, ...] = ()
    condition_types: tuple[str, ...] = ()

    def __init__(self, reconciler: reconcile.Reconciler) -> None:
        self._reconciler = reconciler
        self._history: dict[Key, tuple[tuple[float, int], ...]] = {}
        self._memory: dict[Key, autoscaler.Memory] = {}

    def wants(self, spec: Mapping[str, Any]) -> bool:
        return bool(spec["autoscaling"]["enabled"])

    def forget(self, key: Key) -> None:
        self._history.pop(key, None)
        self._memory.pop(key, None)

    async def step(self, interval: Interval) -> Step:
        engine = interval.engine
        meta, spec = engine["metadata"], engine["spec"]
        key = (meta["namespace"], meta["name"])
        policy = autoscaler.Policy.from_spec(spec["autoscaling"])
        if key not in self._history:
            # Taken over, or restarted: go on from what the last operator left (control_memory.py).
            restored = control_memory.restored_autoscaler(engine.get("status"), policy, now=interval.now)
            if restored is not None:
                self._history[key], self._memory[key] = restored
        decision = autoscaler.decide(
            policy,
            spec["replicas"],
            [metrics.pod_name(pod) for pod in interval.ready],
            interval.starting,
            interval.reading,
            self._history.get(key, ()),
            interval.now,
            self._memory.get(key),
            held=interval.held,
        )
        self._history[key] = decision.history
        self._memory[key] = decision.memory
        about = cast(kopf.Body, engine)
        available = decision.conditions[0]
        if not available.status:
            logger.warning(f"InferenceEngine {key[0]}/{key[1]}: {available.reason}: {available.message}")
            if status.condition(engine, available.type).get("reason") != available.reason:
                kopf.warn(about, reason=available.reason, message=available.message)
        if decision.reason:
            # Before the count: the ReplicaSet picks the pods to delete when it sees the count. A
            # LeaderWorkerSet removes its highest-indexed groups, whatever their pods' cost.
            if not render_lws.spans_pods(spec):
                await self._mark_for_removal(interval.ready, decision.remove)
            await self._reconciler.client.scale(engine, decision.replicas)
            kopf.info(about, reason=decision.reason, message=decision.message)
        now = datetime.datetime.fromtimestamp(interval.now, datetime.UTC)

        def recorded(fresh: Mapping[str, Any]) -> dict[str, Any]:
            new = status.autoscaling(fresh, decision, now=now, scaled=bool(decision.reason))
            if new:
                memory = control_memory.encoded_autoscaler(decision, interval.now)
                new[control_memory.FIELD] = {control_memory.AUTOSCALER: memory}
            return new

        return Step(recorded)

    async def _mark_for_removal(self, ready: Sequence[Mapping[str, Any]], remove: Sequence[str]) -> None:
        """The pods to remove get a pod-deletion-cost below the others' (0, unannotated), so that the
        ReplicaSet deletes them first; a mark left by an earlier scale-down that did not take that
        pod (another writer changed the count) is taken off, so that it does not go next in their
        stead. Only pods whose mark changes are written."""
        for pod in ready:
            marked = (pod["metadata"].get("annotations") or {}).get(autoscaler.POD_DELETION_COST)
            wanted = REMOVE_FIRST if metrics.pod_name(pod) in remove else None
            if marked != wanted:
                await self._reconciler.client.annotate(pod, {autoscaler.POD_DELETION_COST: wanted})
