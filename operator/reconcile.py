"""One reconcile pass: read what rendering needs, server-side-apply the children, write status.

Applying is idempotent: the same spec applies the same objects, the API server keeps them as
they are, and no event is posted. Events go to the InferenceEngine, one per child created or
changed, so that `kubectl describe ie` tells the story.

A child that the operator's last apply left as the pass would render it again is not applied
again: the watches on the children say when one is changed or deleted, and then it is. So a pass
that changes nothing costs a fleet a few reads per engine, not two requests per child.

An engine runs its pods from a Deployment, or over several pods from a LeaderWorkerSet; each pass
reads whether the other kind is left over (parallelism.nodes changed, maybe while no operator
ran) and deletes it. Where the spec needs a LeaderWorkerSet and the cluster serves none, the pass
applies nothing at all, so the pods of the spec before keep serving, and status says what to
install.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import copy
import datetime
import secrets
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import kopf

from kvpilot.operator import kube, naming, pod_parts, render, render_lws, render_router, status

SERVICE_MONITORS = ("monitoring.coreos.com/v1", "servicemonitors")
LEADER_WORKER_SETS = (render_lws.API_VERSION, render_lws.PLURAL)
# How long one discovery answer (are ServiceMonitors, or LeaderWorkerSets, served?) holds for
# every pass: a fleet's passes ask once, and a CRD installed later is seen within this time.
DISCOVERY_TTL_SECONDS = 60.0


@dataclass(frozen=True)
class _Applied:
    """A child as the operator's last apply left it."""

    version: str  # see _version
    manifest: Mapping[str, Any]  # what was applied


class EngineLocks:
    """One asyncio.Lock per engine, kept only while some task holds or awaits it: engines come and
    go for as long as the operator runs, and a lock per engine ever seen would only grow."""

    def __init__(self) -> None:
        self._locks: weakref.WeakValueDictionary[tuple[str, str], asyncio.Lock] = weakref.WeakValueDictionary()

    def __getitem__(self, key: tuple[str, str]) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock

    def __len__(self) -> int:
        return len(self._locks)


class Reconciler:
    def __init__(self, client: kube.Kube, *, unwatched_kinds: frozenset[str] = frozenset(),
                 clock: Callable[[], float] = time.monotonic,
                 on_pass: Callable[[bool], None] = lambda ok: None) -> None:
        """`unwatched_kinds`: children no watch follows (ServiceMonitors whose CRD came after the
        operator started), which every pass applies again. `on_pass(ok)` hears how each pass
        ended: False when an API call failed."""
        self.client = client
        self._on_pass = on_pass
        self._unwatched_kinds = unwatched_kinds
        self._clock = clock
        # (group version, plural) -> (when asked, whether it is served)
        self._served: dict[tuple[str, str], tuple[float, bool]] = {}
        # Status is written from three places (a reconcile pass, the Deployment follower and the
        # control loop); one lock per engine, with fresh reads inside it, keeps an older view from
        # landing last.
        self._status_locks = EngineLocks()
        # Passes are started by the engine's own events and by its children's and Secrets'; one at
        # a time per engine, so that two never both find a child missing (two Created events).
        self._reconcile_locks = EngineLocks()
        # Child path -> the child as the operator's last apply left it: any other version seen
        # later is someone's edit (kubectl scale, set image, edit), to be put back. Dropped when
        # the child is deleted or edited, and unknown after a restart.
        self._applied: dict[str, _Applied] = {}

    async def reconcile(self, engine: Mapping[str, Any]) -> list[str]:
        """Apply the engine's children and refresh its status. Returns the problems that a retry
        may fix (a tenant's key Secret that is missing). A failed call is reported (an Event, and
        for a request the API server refuses, the generation marked Failed) and raised as
        kube.ApiError."""
        meta = engine["metadata"]
        async with self._reconcile_locks[meta["namespace"], meta["name"]]:
            return await self._reconcile_reporting(engine)

    async def reconcile_current(self, namespace: str, name: str) -> None:
        """Reconcile the engine as it is now (not as an older event saw it), unless it is going
        away, or the API server refused its current generation: a spec change clears that."""
        async with self._reconcile_locks[namespace, name]:
            await self._reconcile_fresh(namespace, name)

    async def _reconcile_fresh(self, namespace: str, name: str) -> None:
        engine = await self.client.get(kube.path(naming.API_VERSION, naming.KIND, namespace, name))
        if (engine is None or engine["metadata"].get("deletionTimestamp")
                or status.standing_failure(engine) is not None):
            return
        await self._reconcile_reporting(engine)

    async def _reconcile_reporting(self, engine: Mapping[str, Any]) -> list[str]:
        meta = engine["metadata"]
        try:
            problems = await self._reconcile(engine)
        except kube.ApiError as error:
            self._on_pass(False)
            kopf.warn(_about(engine), reason=status.RECONCILE_FAILED, message=str(error))
            if error.permanent:
                await self.refresh_status(meta["namespace"], meta["name"], failure=str(error))
            raise
        # A missing tenant key is the user's to fix (status and an Event say so): the pass went through.
        self._on_pass(True)
        return problems

    async def _reconcile(self, engine: Mapping[str, Any]) -> list[str]:
        if render_lws.spans_pods(engine["spec"]) and not await self._serves(*LEADER_WORKER_SETS):
            return await self._unserved(engine)
        keys, problems = await self.tenant_keys(engine)
        admin_token = await self.admin_token(engine)
        # Read (or made) only where rendered: an engine without routing reads no more than before.
        cache_salt = await self.cache_salt(engine) if render_router.routed(engine) else ""
        monitor = await self._serves(*SERVICE_MONITORS)
        for child in render.children(engine, tenant_keys=keys, admin_token=admin_token, cache_salt=cache_salt,
                                     service_monitor=monitor):
            await self._apply(engine, child)
        await self._retire_workload(engine)
        if not render_router.routed(engine) and self._routing_was_on(engine):
            # The Service leads to the engines again (applied above), and the routers go.
            for child in render_router.retired(engine):
                await self._delete(engine, child)
        await self.refresh_status(engine["metadata"]["namespace"], engine["metadata"]["name"], problems=problems)
        for problem in problems:
            kopf.warn(_about(engine), reason=status.TENANT_KEY_MISSING, message=problem)
        return problems

    async def _unserved(self, engine: Mapping[str, Any]) -> list[str]:
        message = render_lws.missing_message(engine)
        await self.refresh_status(engine["metadata"]["namespace"], engine["metadata"]["name"], unserved=message)
        kopf.warn(_about(engine), reason=status.LEADER_WORKER_SET_MISSING, message=message)
        return [message]

    async def _retire_workload(self, engine: Mapping[str, Any]) -> None:
        """Delete the engine's workload of the other kind, if there is one (where LeaderWorkerSets
        are not served, there is none to read)."""
        api_version, kind, name = render_lws.retired_workload(engine)
        if kind == render_lws.KIND and not await self._serves(*LEADER_WORKER_SETS):
            return
        path = kube.path(api_version, kind, engine["metadata"]["namespace"], name)
        left = await self.client.get(path)
        if left is not None and naming.owner_name(left) == engine["metadata"]["name"]:
            await self._delete(engine, left)

    async def child_changed(self, child: Mapping[str, Any]) -> None:
        """Put back a child that was changed by hand, and follow a workload's rollout (a Deployment's,
        a LeaderWorkerSet's) into its owner's status."""
        owner = naming.owner_name(child)
        if owner is None:
            return
        namespace = child["metadata"]["namespace"]
        if self._applied_by_operator(child):
            if child["kind"] in _WORKLOAD_KINDS:
                await self.refresh_status(namespace, owner)
            return
        async with self._reconcile_locks[namespace, owner]:
            # The event may be older than the pass that held the lock, which made this version
            # itself or put the edit back already: only the child as it is now tells. One gone
            # is its DELETED event's to handle.
            current = await self.read_child(kube.path_of(child))
            if current is not None and not self._applied_by_operator(current):
                await self._reconcile_fresh(namespace, owner)

    async def read_child(self, path: str) -> dict[str, Any] | None:
        """A child as it is now. One that is not as the operator left it (gone, or changed) is
        forgotten, so that the next pass applies it again even where no watch told of it."""
        current = await self.client.get(path)
        if current is None or not self._applied_by_operator(current):
            self._applied.pop(path, None)
        return current

    async def child_listed(self, child: Mapping[str, Any]) -> None:
        """A child in a watch's listing (at startup, or after a watch reconnected): one that the
        operator applied since it started, changed while no watch streamed, is put back."""
        if kube.path_of(child) in self._applied:
            await self.child_changed(child)

    def _applied_by_operator(self, child: Mapping[str, Any]) -> bool:
        """Whether the child is as the operator's last apply left it; unknown after a restart,
        when the engine's resume applies it again anyway."""
        applied = self._applied.get(kube.path_of(child))
        return applied is not None and applied.version == _version(child)

    def as_applied(self, child: Mapping[str, Any]) -> bool:
        """Whether the operator's last apply of this child applied exactly `child`, and nothing
        has changed it since (as far as its watch has told)."""
        applied = self._applied.get(kube.path_of(child))
        return applied is not None and applied.manifest == child

    async def apply_child(self, child: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side-apply one child, remembering what it applied and the version it leaves."""
        after = await self.client.apply(child)
        self._applied[kube.path_of(child)] = _Applied(_version(after), copy.deepcopy(child))
        return after

    async def child_deleted(self, child: Mapping[str, Any]) -> None:
        """Apply the children again after one was deleted, unless its owner is going away too."""
        self._applied.pop(kube.path_of(child), None)
        owner = naming.owner_name(child)
        if owner is not None:
            await self.reconcile_current(child["metadata"]["namespace"], owner)

    async def refresh_status(self, namespace: str, name: str, *, failure: str | None = None,
                             problems: list[str] | None = None, unserved: str | None = None) -> None:
        async def derived(engine: Mapping[str, Any]) -> dict[str, Any]:
            api_version, kind, workload_name = render_lws.workload(engine)
            workload = await self.client.get(kube.path(api_version, kind, namespace, workload_name))
            routers = None
            if render_router.routed(engine):
                routers = await self.client.get(
                    kube.path("apps/v1", "Deployment", namespace, naming.router_name(name)))
            return status.derive(engine, workload, routers=routers, now=datetime.datetime.now(datetime.UTC),
                                 failure=failure, problems=problems, unserved=unserved)

        await self.update_status(namespace, name, derived)

    async def update_status(
        self, namespace: str, name: str, change: Callable[[Mapping[str, Any]], Awaitable[Mapping[str, Any]]]
    ) -> None:
        """Write the status fields that `change` derives from a fresh read of the engine, if they
        change anything; every status writer goes through here."""
        async with self._status_locks[namespace, name]:
            engine = await self.client.get(kube.path(naming.API_VERSION, naming.KIND, namespace, name))
            if engine is None or engine["metadata"].get("deletionTimestamp"):
                return  # going away; garbage collection takes the children along
            new = await change(engine)
            if status.changed(engine, new):
                await self.client.patch_status(engine, new)

    async def tenant_keys(self, engine: Mapping[str, Any]) -> tuple[dict[str, str], list[str]]:
        """Each tenant's API key, base64 as in its Secret's data (never decoded here), and a
        message for each tenant whose key cannot be found."""
        namespace = engine["metadata"]["namespace"]
        keys: dict[str, str] = {}
        problems: list[str] = []
        secrets: dict[str, dict[str, Any] | None] = {}
        for tenant in engine["spec"]["scheduling"].get("tenants", []):
            ref = tenant.get("apiKeySecretRef")
            if ref is None:
                continue
            if ref["name"] not in secrets:
                secrets[ref["name"]] = await self.client.get(kube.path("v1", "Secret", namespace, ref["name"]))
            secret = secrets[ref["name"]]
            if secret is None:
                problems.append(f"tenant {tenant['name']}: Secret {ref['name']} does not exist")
            elif ref["key"] not in secret.get("data", {}):
                problems.append(f"tenant {tenant['name']}: Secret {ref['name']} has no key {ref['key']}")
            else:
                keys[tenant["name"]] = secret["data"][ref["key"]]
        return keys, problems

    async def admin_token(self, engine: Mapping[str, Any]) -> str:
        """The engine's admin token, base64 as in its Secret: the one stored, or a new random one
        where none is, or where what is stored is not a token (the pods re-read the token file,
        so even a lost race is no outage)."""
        return await self._kept_secret(engine, naming.admin_token_secret_name, render.ADMIN_TOKEN_KEY)

    async def cache_salt(self, engine: Mapping[str, Any]) -> str:
        """The fleet's salt secret, base64 as in its Secret, kept as the admin token is. Made anew
        only where none is stored: every tenant's prefix cache starts cold then, and the engines
        and routers read the new one alike."""
        return await self._kept_secret(engine, naming.cache_salt_secret_name, pod_parts.CACHE_SALT_KEY)

    async def admin_token_in_use(self, engine: Mapping[str, Any]) -> str | None:
        """The token the engine's pods accept, decoded; None where its Secret is missing or holds none.
        Read from the Secret itself: it is what the pods read, whatever happened to it."""
        meta = engine["metadata"]
        return decoded_token(await self._stored_secret(
            meta, naming.admin_token_secret_name, render.ADMIN_TOKEN_KEY, as_applied=False))

    async def _kept_secret(self, engine: Mapping[str, Any], secret_name: Callable[[str], str], key: str) -> str:
        """A random token that the operator makes once and keeps in a Secret of its own."""
        stored = await self._stored_secret(engine["metadata"], secret_name, key, as_applied=True)
        if stored is not None and decoded_token(stored) is not None:
            return stored
        return base64.b64encode(secrets.token_urlsafe(32).encode()).decode()

    async def _stored_secret(self, meta: Mapping[str, Any], secret_name: Callable[[str], str], key: str, *,
                             as_applied: bool) -> str | None:
        """`as_applied`: as the operator last applied it, where nothing changed it since."""
        path = kube.path("v1", "Secret", meta["namespace"], secret_name(meta["name"]))
        applied = self._applied.get(path) if as_applied else None
        secret = applied.manifest if applied is not None else await self.read_child(path)
        return (secret or {}).get("data", {}).get(key) or None

    async def _serves(self, group_version: str, plural: str) -> bool:
        now = self._clock()
        asked = self._served.get((group_version, plural))
        if asked is None or now - asked[0] >= DISCOVERY_TTL_SECONDS:
            asked = self._served[group_version, plural] = (now, await self.client.serves(group_version, plural))
        return asked[1]

    def _routing_was_on(self, engine: Mapping[str, Any]) -> bool:
        """Known without a read: RouterReady in status (dropped once routing is off, so a
        later pass reads none), or routers this operator applied since it started (a quick
        flip, before status told)."""
        meta = engine["metadata"]
        routers = kube.path("apps/v1", "Deployment", meta["namespace"], naming.router_name(meta["name"]))
        return bool(status.condition(engine, status.ROUTER_READY)) or routers in self._applied

    async def _delete(self, engine: Mapping[str, Any], child: Mapping[str, Any]) -> None:
        self._applied.pop(kube.path_of(child), None)
        if await self.client.delete(kube.path_of(child)):
            kopf.info(_about(engine), reason="Deleted", message=f"Deleted {child['kind']} {child['metadata']['name']}")

    async def _apply(self, engine: Mapping[str, Any], child: Mapping[str, Any]) -> None:
        if child["kind"] not in self._unwatched_kinds and self.as_applied(child):
            return
        # Known to the operator: it exists, and this apply changes it. Unknown (after a restart,
        # a deletion or an edit): what the API server holds tells.
        known = kube.path_of(child) in self._applied
        before = None if known else await self.client.get(kube.path_of(child))
        after = await self.apply_child(child)
        what = f"{child['kind']} {child['metadata']['name']}"
        if not known and before is None:
            kopf.info(_about(engine), reason="Created", message=f"Created {what}")
        elif known or before["metadata"].get("resourceVersion") != after["metadata"].get("resourceVersion"):
            kopf.info(_about(engine), reason="Updated", message=f"Updated {what}")


# What runs an engine's pods: their rollouts are followed into its status.
_WORKLOAD_KINDS = frozenset({"Deployment", render_lws.KIND})
# Kinds whose status changes all the time (their controllers' writes) and whose generation
# changes only with their spec: for them the generation is the version an edit changes.
_STATUS_BUSY_KINDS = frozenset({*_WORKLOAD_KINDS, "PodDisruptionBudget"})


def _version(child: Mapping[str, Any]) -> str:
    meta = child["metadata"]
    if child["kind"] in _STATUS_BUSY_KINDS:
        return f"generation {meta.get('generation')}"
    return f"resourceVersion {meta.get('resourceVersion')}"


def decoded_token(encoded: str | None) -> str | None:
    """A token from a Secret's data (base64), or None where there is none."""
    if encoded is None:
        return None
    try:
        return base64.b64decode(encoded, validate=True).decode().strip() or None
    except (binascii.Error, UnicodeDecodeError):
        return None


def _about(engine: Mapping[str, Any]) -> kopf.Body:
    # kopf builds an event's object reference from apiVersion, kind and metadata, which any
    # engine object has, whether kopf delivered it or the client read it.
    return cast(kopf.Body, engine)
