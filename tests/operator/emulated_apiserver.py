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
- generateName.

Tests can also make the next matching write fail with `fail_next(...)`.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import random
import uuid
from typing import Any

import attrs
import jsonpatch
import kmock
from kmock import action

JSON = dict[str, Any]


class EmulatedApiServer(kmock.KubernetesEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._versions = itertools.count(1)
        self._failures: list[tuple[str, str, int]] = []
        self._flaky: tuple[float, tuple[int, ...], str, random.Random] | None = None

    def fail_next(self, method: str, plural: str, status: int = 500) -> None:
        """Answer the next `method` request on `plural` with `status`, changing nothing."""
        self._failures.append((method.upper(), plural, status))

    def fail_share(self, share: float, statuses: tuple[int, ...], user_agent: str, seed: int = 0) -> None:
        """Answer about `share` of the requests from `user_agent` with one of `statuses`, changing nothing."""
        self._flaky = (share, statuses, user_agent, random.Random(seed))

    def _flaky_failure(self, request: kmock.Request) -> int | None:
        if self._flaky is None or request.headers.get("User-Agent") != self._flaky[2]:
            return None
        share, statuses, _, rng = self._flaky
        return rng.choice(statuses) if rng.random() < share else None

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is not None:
            flaky = self._flaky_failure(request)
            if flaky is not None:
                raise kmock.KubernetesError(status=flaky, reason="InjectedFailure", message="injected by the test")
            for failure in self._failures:
                method, plural, status = failure
                if request.method == method and request.resource.plural == plural:
                    self._failures.remove(failure)
                    raise kmock.KubernetesError(status=status, reason="InjectedFailure", message="injected by the test")
            if request.action == action.CREATE:
                request = self._replace(request, data=self._created(request.data, request.namespace))
            elif request.action == action.UPDATE and request.name is not None:
                request = self._updated(request)
        return await super()._handle(request)

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
        if applying:
            new = _applied(old, request.data)
        elif isinstance(request.data, list):
            new = jsonpatch.apply_patch(old, request.data)
        else:
            new = _merged(old, request.data)

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


def _merged(old: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(old) if isinstance(old, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merged(result.get(key), value)
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
