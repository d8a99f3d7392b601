"""kmock's KubernetesEmulator, plus the API-server behaviour that the operator tests rely on.

kmock keeps objects and serves list/watch/get/create/patch, but patches are plain dict merges and
it maintains no server-set metadata. This subclass does, for every write, what a real API server
would do before storing the object:

- metadata: uid, creationTimestamp, resourceVersion (bumped only by real changes, so a no-op
  write is a no-op), generation (bumped only by changes outside metadata and status);
- server-side apply (`application/apply-patch+yaml`): creates a missing object, and otherwise
  takes the applied fields as the truth for everything but metadata (merged) and status (kept),
  which is what apply means for a sole field manager;
- the status subresource: a write to /status changes only status; a write to the main resource
  never changes status;
- the scale subresource: a write to /scale changes only spec.replicas (every kind here keeps its
  replicas there);
- label selectors on lists (`labelSelector`, equality terms only);
- generateName;
- optimistic concurrency: a write that names a resourceVersion other than the stored one gets
  409 Conflict (leader election relies on it).

Faults, for the tests that inject them (`inject(Fault(...))`, `fail_next`, `fail_share`): an
error answer (with Retry-After where asked), a slow answer, a watch stream cut after a number of
events, and a watch answering 410 Gone.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import attrs
import jsonpatch
import kmock
from kmock import action

JSON = dict[str, Any]


@dataclass
class Fault:
    """What the emulator does instead of serving a matching request, `times` times (None: always):
    answer `status` (with Retry-After: `retry_after` seconds, where given) after `delay` seconds,
    changing nothing; or, with `status` None, serve it after the delay (a slow answer). With
    `events`, it cuts watch streams instead, running ones included: each ends after sending
    `events` more events, before the next (with an ERROR event of code `status` first, where
    that is given)."""

    matches: Callable[[kmock.Request], bool]
    status: int | None = 500
    delay: float = 0.0
    retry_after: float | None = None
    events: int | None = None
    times: int | None = 1
    hit: list[kmock.Request] = field(default_factory=list)  # the requests it answered

    @property
    def hits(self) -> int:
        return len(self.hit)


@attrs.frozen
class _Injected(kmock.KubernetesError):
    retry_after: float | None = None


class EmulatedApiServer(kmock.KubernetesEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._versions = itertools.count(1)
        self.faults: list[Fault] = []
        # request id -> when it arrived (time.monotonic()), for tests of retry timing.
        self.arrived: dict[int, float] = {}
        self._flaky: tuple[float, tuple[int, ...], str, random.Random] | None = None

    def inject(self, fault: Fault) -> Fault:
        self.faults.append(fault)
        return fault

    def fail_next(self, method: str, plural: str, status: int = 500) -> None:
        """Answer the next `method` request on `plural` with `status`, changing nothing."""
        self.inject(Fault(lambda r: r.method == method.upper() and r.resource.plural == plural, status))

    def fail_share(self, share: float, statuses: tuple[int, ...], user_agent: str, seed: int = 0) -> None:
        """Answer about `share` of the requests from `user_agent` with one of `statuses`, changing nothing."""
        self._flaky = (share, statuses, user_agent, random.Random(seed))

    def _flaky_failure(self, request: kmock.Request) -> int | None:
        if self._flaky is None or request.headers.get("User-Agent") != self._flaky[2]:
            return None
        share, statuses, _, rng = self._flaky
        return rng.choice(statuses) if rng.random() < share else None

    async def _handle(self, request: kmock.Request) -> Any:
        self.arrived[request.id] = time.monotonic()
        if request.resource is not None:
            flaky = self._flaky_failure(request)
            if flaky is not None:
                raise kmock.KubernetesError(status=flaky, reason="InjectedFailure", message="injected by the test")
            fault = self._fault(request)
            if fault is not None and fault.delay:
                await asyncio.sleep(fault.delay)
            if fault is not None and fault.status is not None:
                raise _Injected(status=fault.status, reason="InjectedFailure", message="injected by the test",
                                retry_after=fault.retry_after)
            if request.action == action.CREATE:
                request = self._replace(request, data=self._created(request.data, request.namespace))
            elif request.action == action.UPDATE and request.name is not None:
                request = self._updated(request)
        return await super()._handle(request)

    def _fault(self, request: kmock.Request) -> Fault | None:
        for fault in self.faults:
            if fault.events is None and fault.matches(request):
                fault.hit.append(request)
                if fault.times is not None and fault.hits >= fault.times:
                    self.faults.remove(fault)
                return fault
        return None

    async def _render_error(self, exc: Exception) -> Any:
        response = await super()._render_error(exc)
        if isinstance(exc, _Injected) and exc.retry_after is not None:
            response.headers["Retry-After"] = f"{exc.retry_after:g}"
        return response

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        passed: dict[int, int] = {}  # per cut fault: the events this stream sent since it was injected
        async for event in super()._serve_watch(request):
            cut = next((f for f in self.faults if f.events is not None and f.matches(request)), None)
            if cut is not None and event != b"":
                if passed.setdefault(id(cut), 0) >= cut.events:
                    # The connection ends mid-stream, this event unsent, as when a proxy or an
                    # API server restarts; with a status, the API server says why first, as it
                    # does (410) when the watch's resourceVersion has been compacted away.
                    cut.hit.append(request)
                    if cut.times is not None and cut.hits >= cut.times:
                        self.faults.remove(cut)
                    if cut.status is not None:
                        yield {"type": "ERROR", "object": {"apiVersion": "v1", "kind": "Status", "status": "Failure",
                                                           "reason": "Expired", "code": cut.status,
                                                           "message": "too old resource version"}}
                    return
                passed[id(cut)] += 1
            yield event

    def _replace(self, request: kmock.Request, **changes: Any) -> kmock.Request:
        # kmock routes a request by its identity in the list of received requests, so the
        # rewritten request takes the original's place there.
        new = attrs.evolve(request, **changes)
        index = next(i for i, seen in enumerate(self._requests) if seen is request)
        self._requests[index] = new
        return new

    def _created(self, data: JSON, namespace: str | None) -> JSON:
        obj = copy.deepcopy(data)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if namespace is not None:
            meta.setdefault("namespace", namespace)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        meta["resourceVersion"] = str(next(self._versions))
        meta["generation"] = 1
        return obj

    def _updated(self, request: kmock.Request) -> kmock.Request:
        key = (request.resource, request.namespace, request.name)
        applying = request.headers.get("Content-Type", "").startswith("application/apply-patch")
        if key not in self.objects or self.objects[key].deleted:
            if applying:
                return self._replace(request, action=action.CREATE, data=self._created(request.data, request.namespace))
            return request  # kmock answers 404
        old = copy.deepcopy(self.objects[key].raw)
        precondition = (request.data.get("metadata") or {}).get("resourceVersion") \
            if isinstance(request.data, dict) else None
        if precondition is not None and precondition != old["metadata"].get("resourceVersion"):
            raise kmock.KubernetesError(status=409, reason="Conflict", message=(
                "the object has been modified; please apply your changes to the latest version and try again"))
        if applying:
            new = _applied(old, request.data)
        elif isinstance(request.data, list):
            new = jsonpatch.apply_patch(old, request.data)
        else:
            new = merge_patched(old, request.data)

        if request.subresource == "status":
            new = {**old, "status": new.get("status")}
        elif request.subresource == "scale":
            new = copy.deepcopy(old)
            new["spec"]["replicas"] = request.data["spec"]["replicas"]
        elif self._has_status_subresource(request.resource):
            new = {key: value for key, value in new.items() if key != "status"}
            if "status" in old:
                new["status"] = old["status"]

        if new == old:
            return self._replace(request, action=action.FETCH)  # nothing changes, nothing is stored
        new.setdefault("metadata", {})["resourceVersion"] = str(next(self._versions))
        if _content(new) != _content(old):
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        return self._replace(request, data=_merge_patch(old, new))

    async def _serve_list(self, request: kmock.Request) -> Any:
        listing = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        if selector:
            wanted = dict(term.split("=", 1) for term in selector.split(","))
            listing["items"] = [
                item for item in listing["items"]
                if wanted.items() <= (item.get("metadata", {}).get("labels") or {}).items()
            ]
        return listing

    def _has_status_subresource(self, resource: Any) -> bool:
        return resource in self.resources and "status" in self.resources[resource].subresources


def _content(obj: JSON) -> JSON:
    return {key: value for key, value in obj.items() if key not in ("metadata", "status")}


def merge_patched(old: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(old) if isinstance(old, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patched(result.get(key), value)
    return result


def _applied(old: JSON, applied: JSON) -> JSON:
    new = copy.deepcopy(applied)
    meta = copy.deepcopy(old.get("metadata", {}))
    for key, value in applied.get("metadata", {}).items():
        meta[key] = {**meta.get(key, {}), **value} if key in ("labels", "annotations") else copy.deepcopy(value)
    new["metadata"] = meta
    if "status" in old:
        new["status"] = old["status"]
    return new


def _merge_patch(old: Any, new: Any) -> Any:
    """The merge patch that turns `old` into `new` (kmock stores writes as merge patches)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return copy.deepcopy(new)
    patch: JSON = {key: None for key in old if key not in new}
    for key, value in new.items():
        if key not in old:
            patch[key] = copy.deepcopy(value)
        elif old[key] != value:
            patch[key] = _merge_patch(old[key], value)
    return patch
