"""The kopf wiring: which events run which reconcile step (the steps live in reconcile.py).

Handlers go to this module's own `registry`, which `kvpilot operator` runs; nothing is
registered globally on import. No deletion handler, daemon or timer is registered: each of those
would make kopf put a finalizer on every InferenceEngine, and deletion needs none, because every
child carries an ownerReference and the garbage collector removes it. The control loop
(autoscaling, policy tuning) is an operator-level task per engine, started and stopped by a plain
event handler, for the same reason.

Besides the engines, it follows their Deployments and LeaderWorkerSets (the rollout, into
status), every child (one
deleted or edited by hand is applied again at once) and the Secrets that hold tenants' API keys (a
rotated or revoked key is copied again at once). Every pass of one engine runs after the last
(reconcile.py).
"""

from __future__ import annotations

from typing import Any

import kopf

from kvpilot.operator import control, exported_metrics, kube, metrics, naming, reconcile

registry = kopf.OperatorRegistry()

_ENGINES = (naming.GROUP, naming.VERSION, naming.PLURAL)
_OWN_CHILDREN = {naming.MANAGED_BY_LABEL: naming.FIELD_MANAGER}
_DEPLOYMENTS = ("apps", "v1", "deployments")
# Followed where their CRD is served when the operator starts, as ServiceMonitors are (below).
_LEADER_WORKER_SETS = ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")
_SERVICES = ("", "v1", "services")
_CONFIG_MAPS = ("", "v1", "configmaps")
_PDBS = ("policy", "v1", "poddisruptionbudgets")
# The routers' identity and rights (with routing).
_SERVICE_ACCOUNTS = ("", "v1", "serviceaccounts")
_ROLES = ("rbac.authorization.k8s.io", "v1", "roles")
_ROLE_BINDINGS = ("rbac.authorization.k8s.io", "v1", "rolebindings")
# Followed where their CRD (the Prometheus Operator's) is served when the operator starts; where
# it is not, kopf says so once in its log and watches the rest (scanning is off, so a CRD
# installed later is followed from the next start; each pass still applies its ServiceMonitor).
_SERVICE_MONITORS = ("monitoring.coreos.com", "v1", "servicemonitors")
_CHILD_RESOURCES = (_DEPLOYMENTS, _LEADER_WORKER_SETS, _SERVICES, _CONFIG_MAPS, _PDBS, _SERVICE_ACCOUNTS, _ROLES,
                    _ROLE_BINDINGS, _SERVICE_MONITORS)
LIST_CHUNK_SIZE = 500

# Retry delays after a failed API call: 1 s, doubling, at most 5 minutes.
RETRY_BASE_SECONDS = 1.0
RETRY_MAX_SECONDS = 300.0


def retry_delay(retry: int) -> float:
    return min(RETRY_BASE_SECONDS * 2**retry, RETRY_MAX_SECONDS)


@kopf.on.startup(registry=registry)
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # kopf's bookkeeping goes into annotations: the CRD's structural schema would prune it
    # from status.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=naming.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=naming.GROUP, key="last-handled-configuration"
    )
    # Scanning watches Namespaces and CRDs cluster-wide. Without it the operator needs no rights
    # on either; the price is that the CRD must exist when the operator starts (the chart
    # installs it first).
    settings.scanning.disabled = True
    # A watch connection can die silently; these make it end and restart instead of hanging.
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300
    # The API server streams only the operator's own children; every Secret is streamed (the
    # tenants' key Secrets are the users', unlabelled), so listings come in chunks, and a
    # cluster's worth of Secrets is never in memory at once.
    for resource in _CHILD_RESOURCES:
        settings.watching.label_selectors[resource] = f"{naming.MANAGED_BY_LABEL}={naming.FIELD_MANAGER}"
    settings.watching.chunk_size = LIST_CHUNK_SIZE
    # Tests shorten the API calls' timeout, to answer slower than it.
    client = kube.Kube(settings, timeout=memo.get("api_timeout_seconds", kube.TIMEOUT_S))
    memo.exported = exported_metrics.OperatorMetrics()
    # `kvpilot operator --metrics-endpoint` (tests pass their own); none where it is empty.
    endpoint = memo.get("metrics_endpoint")
    memo.metrics_server = await exported_metrics.serve(endpoint, memo.exported.render) if endpoint else None
    memo.reconciler = reconcile.Reconciler(client, unwatched_kinds=await _unwatched_kinds(client),
                                           on_pass=memo.exported.reconciled)
    # Tests point the direct scrape and the policy tuner's calls at fake pods of their own, where
    # pods have no reachable IP.
    memo.control = control.ControlLoops(
        memo.reconciler,
        pod_metrics_url=memo.get("pod_metrics_url", metrics.pod_metrics_url),
        pod_url=memo.get("pod_url", metrics.pod_url),
    )


async def _unwatched_kinds(client: kube.Kube) -> frozenset[str]:
    # kopf resolves the watched resources once, after this handler (scanning is off): a
    # ServiceMonitor CRD that is not served now is not followed until the next start.
    try:
        if await client.serves(*reconcile.SERVICE_MONITORS):
            return frozenset()
    except kube.ApiError:
        pass  # not known: each pass applies them, which is right either way
    return frozenset({"ServiceMonitor"})


@kopf.on.cleanup(registry=registry)
async def close(memo: kopf.Memo, **_: Any) -> None:
    await memo.control.close()
    await memo.reconciler.client.close()
    if memo.metrics_server is not None:
        await memo.metrics_server.cleanup()


@kopf.on.login(registry=registry)
def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo | None:
    return kube.login(settings)


@kopf.on.resume(*_ENGINES, registry=registry)
@kopf.on.create(*_ENGINES, registry=registry)
@kopf.on.update(*_ENGINES, registry=registry)
async def reconcile_engine(body: kopf.Body, memo: kopf.Memo, retry: int, **_: Any) -> None:
    try:
        problems = await memo.reconciler.reconcile(body)
    except kube.ApiError as error:
        # Reported already (an Event, and Failed in status where the API server refused it).
        if error.permanent:
            raise kopf.PermanentError(str(error)) from error
        raise kopf.TemporaryError(str(error), delay=retry_delay(retry)) from error
    if problems:
        raise kopf.TemporaryError("; ".join(problems), delay=retry_delay(retry))


@kopf.on.event(*_ENGINES, registry=registry)
async def follow_engine(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    memo.control.follow(body, deleted=type == "DELETED")
    if type == "DELETED":
        memo.exported.forget(body["metadata"]["namespace"], body["metadata"]["name"])
    else:
        memo.exported.observe(body)


@kopf.on.event(*_DEPLOYMENTS, labels=_OWN_CHILDREN, registry=registry)
@kopf.on.event(*_LEADER_WORKER_SETS, labels=_OWN_CHILDREN, registry=registry)
async def workload_event(
    type: str | None, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    try:
        await _follow_child(type, body, memo)
    except kube.ApiError as error:
        # The next event of this workload, or of its engine, brings the status up to date.
        logger.warning(f"Could not follow the {body.get('kind', 'workload')}: {error}")


# The other children: one deleted or edited by hand is applied again (the Secrets are followed
# below).
@kopf.on.event(*_SERVICES, labels=_OWN_CHILDREN, registry=registry)
@kopf.on.event(*_CONFIG_MAPS, labels=_OWN_CHILDREN, registry=registry)
@kopf.on.event(*_PDBS, labels=_OWN_CHILDREN, registry=registry)
@kopf.on.event(*_SERVICE_ACCOUNTS, labels=_OWN_CHILDREN, registry=registry)
@kopf.on.event(*_ROLES, labels=_OWN_CHILDREN, registry=registry)
@kopf.on.event(*_ROLE_BINDINGS, labels=_OWN_CHILDREN, registry=registry)
@kopf.on.event(*_SERVICE_MONITORS, labels=_OWN_CHILDREN, registry=registry)
async def child_event(type: str | None, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    try:
        await _follow_child(type, body, memo)
    except kube.ApiError as error:
        # The engine's next event, or the operator's restart (a resume), applies it again.
        logger.warning(f"Could not put back {body.get('kind', 'an object')} {body['metadata']['name']}: {error}")


async def _follow_child(type: str | None, body: kopf.Body, memo: kopf.Memo) -> None:
    if type is None:
        # A listing: at startup every engine's resume applies its children anyway; after a
        # watch reconnected, it shows what changed while none streamed.
        await memo.reconciler.child_listed(body)
    elif type == "DELETED":
        await memo.reconciler.child_deleted(body)
    else:
        await memo.reconciler.child_changed(body)


@kopf.index(*_ENGINES, registry=registry)
def engines_by_key_secret(namespace: str, name: str, spec: kopf.Spec, **_: Any) -> dict[tuple[str, str], str]:
    """(namespace, Secret) -> the engine, for each Secret that holds a tenant's API key."""
    return {(namespace, ref["name"]): name
            for tenant in spec.get("scheduling", {}).get("tenants", []) if (ref := tenant.get("apiKeySecretRef"))}


# Every Secret, not only the operator's own: the tenants' key Secrets are the users', unlabelled,
# and the operator copies their keys, so a rotated or revoked key must be copied again at once.
@kopf.on.event("", "v1", "secrets", registry=registry)
async def secret_event(
    type: str | None, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, engines_by_key_secret: kopf.Index,
    **_: Any,
) -> None:
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    try:
        if naming.owner_name(body) is not None:
            await _follow_child(type, body, memo)
        if type is None:
            return  # a listing: every engine's resume reads its tenants' keys anyway
        for engine in sorted(set(engines_by_key_secret.get((namespace, name), []))):
            await memo.reconciler.reconcile_current(namespace, engine)
    except kube.ApiError as error:
        logger.warning(f"Could not follow Secret {namespace}/{name}: {error}")
