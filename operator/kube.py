"""A small asyncio client for the few Kubernetes API calls the reconciler makes.

kopf watches and patches the InferenceEngines itself; this client reads and server-side-applies
the children. It logs in the same way as the operator's kopf login handler, and logs in again
once when the API answers 401 (service-account tokens are rotated while the operator runs).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import aiohttp
import kopf

from kvpilot.operator import naming

# kind -> plural, for every kind the operator reads or writes.
PLURALS = {
    "Pod": "pods",
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "Service": "services",
    "Deployment": "deployments",
    "LeaderWorkerSet": "leaderworkersets",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "ServiceMonitor": "servicemonitors",
    "ServiceAccount": "serviceaccounts",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "Lease": "leases",
    naming.KIND: naming.PLURAL,
}

# Statuses that a retry cannot fix: the request itself is wrong.
_PERMANENT_STATUSES = frozenset({400, 422})
# Answers (0: no answer) that a second try often gets past: a conflict, an overloaded or
# restarting API server, a dropped connection. Every call here is idempotent (GET, server-side
# apply, a merge patch of status), so it is retried at once, a few times, before a reconcile pass
# fails: a pass re-applies every child, and without this each one would need every call of the
# pass to succeed in a row.
_TRANSIENT_STATUSES = frozenset({0, 409, 429, 500, 502, 503, 504})
RETRY_DELAYS_S = (0.1, 0.2, 0.4)
# An API server that sends Retry-After (a 429 from API priority and fairness) is waited for, but
# no longer than this: a pass that waits longer is better failed and retried with kopf's backoff.
MAX_RETRY_AFTER_S = 10.0
TIMEOUT_S = 30.0


class ApiError(Exception):
    """A failed API call; `status` is 0 where no HTTP answer came back."""

    def __init__(self, status: int, reason: str, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(f"{status} {reason}: {message}" if status else f"{reason}: {message}")
        self.status = status
        self.retry_after = retry_after  # the seconds the API server asked to wait, if it did

    @property
    def permanent(self) -> bool:
        return self.status in _PERMANENT_STATUSES


def login(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo | None:
    """In a pod, its service account; elsewhere (development, tests), the kubeconfig."""
    return (
        kopf.login_with_service_account(settings=settings)
        or kopf.login_with_kubeconfig(settings=settings)
    )


def path(api_version: str, kind: str, namespace: str, name: str) -> str:
    prefix = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{namespace}/{PLURALS[kind]}/{name}"


def path_of(obj: Mapping[str, Any]) -> str:
    meta = obj["metadata"]
    return path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])


class Kube:
    def __init__(self, settings: kopf.OperatorSettings, *, timeout: float = TIMEOUT_S) -> None:
        self._settings = settings
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._server = ""

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def get(self, url: str) -> dict[str, Any] | None:
        """The object at `url`, or None where there is none."""
        try:
            return await self._request("GET", url)
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    async def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply as the operator's field manager; `force` takes fields back from
        anyone who edited them by hand, which is what reconciling means."""
        return await self._request(
            "PATCH",
            path_of(obj),
            params={"fieldManager": naming.FIELD_MANAGER, "force": "true"},
            body=obj,
            content_type="application/apply-patch+yaml",
        )

    async def delete(self, url: str) -> bool:
        """Delete the object at `url`; False where there was none."""
        try:
            await self._request("DELETE", url)
        except ApiError as error:
            if error.status == 404:
                return False
            raise
        return True

    async def list(self, api_version: str, kind: str, namespace: str, *, selector: str) -> list[dict[str, Any]]:
        """The objects of one kind in `namespace` that match a label selector."""
        url = path(api_version, kind, namespace, "").rstrip("/")
        return (await self._request("GET", url, params={"labelSelector": selector})).get("items", [])

    async def scale(self, obj: Mapping[str, Any], replicas: int) -> dict[str, Any]:
        """Write spec.replicas through the scale subresource, as `kubectl scale` does."""
        return await self._request(
            "PATCH",
            f"{path_of(obj)}/scale",
            body={"spec": {"replicas": replicas}},
            content_type="application/merge-patch+json",
        )

    async def annotate(self, obj: Mapping[str, Any], annotations: Mapping[str, str | None]) -> dict[str, Any]:
        """Set annotations on an object (None removes one), leaving the rest of it alone."""
        return await self._request(
            "PATCH",
            path_of(obj),
            body={"metadata": {"annotations": dict(annotations)}},
            content_type="application/merge-patch+json",
        )

    async def patch_status(self, obj: Mapping[str, Any], status: Mapping[str, Any]) -> dict[str, Any]:
        return await self._request(
            "PATCH",
            f"{path_of(obj)}/status",
            body={"status": status},
            content_type="application/merge-patch+json",
        )

    async def create_once(self, obj: Mapping[str, Any], *, timeout: float) -> dict[str, Any]:
        """Create `obj`, once, within `timeout` seconds: 409 means someone else made it first."""
        url = path(obj["apiVersion"], obj["kind"], obj["metadata"]["namespace"], "").rstrip("/")
        return await self._request_once(("POST", url, None, obj, "application/json"), timeout=timeout)

    async def patch_once(self, url: str, patch: Mapping[str, Any], *, timeout: float) -> dict[str, Any]:
        """A merge patch, once, within `timeout` seconds. A patch that names a resourceVersion is
        refused with 409 unless the object is still that version: the caller decides again."""
        return await self._request_once(("PATCH", url, None, patch, "application/merge-patch+json"), timeout=timeout)

    async def get_once(self, url: str, *, timeout: float) -> dict[str, Any] | None:
        """The object at `url` (None where there is none), asked once, within `timeout` seconds."""
        try:
            return await self._request_once(("GET", url, None, None, None), timeout=timeout)
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    async def serves(self, group_version: str, plural: str) -> bool:
        """Whether the cluster serves a resource, e.g. ServiceMonitors where their CRD is installed."""
        listing = await self.get(f"/apis/{group_version}")
        return listing is not None and any(r.get("name") == plural for r in listing.get("resources", []))

    async def _request(
        self,
        method: str,
        url: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Mapping[str, Any] | None = None,
        content_type: str | None = None,
    ) -> dict[str, Any]:
        request = (method, url, params, body, content_type)
        for delay in RETRY_DELAYS_S:
            try:
                return await self._request_once(request)
            except ApiError as error:
                if error.status not in _TRANSIENT_STATUSES:
                    raise
                if error.retry_after is not None:
                    delay = min(error.retry_after, MAX_RETRY_AFTER_S)
            await asyncio.sleep(delay)
        return await self._request_once(request)

    async def _request_once(self, request: tuple, *, timeout: float | None = None) -> dict[str, Any]:
        limit = self._timeout if timeout is None else aiohttp.ClientTimeout(total=timeout)
        status, headers, payload = await self._send(*request, fresh_login=False, timeout=limit)
        if status == 401:
            status, headers, payload = await self._send(*request, fresh_login=True, timeout=limit)
        if status >= 400:
            raise _error(status, payload, retry_after=_seconds(headers.get("Retry-After")))
        return json.loads(payload) if payload else {}

    async def _send(
        self,
        method: str,
        url: str,
        params: Mapping[str, str] | None,
        body: Mapping[str, Any] | None,
        content_type: str | None,
        *,
        fresh_login: bool,
        timeout: aiohttp.ClientTimeout,
    ) -> tuple[int, Mapping[str, str], bytes]:
        session = await self._connect(fresh=fresh_login)
        headers = {"Content-Type": content_type} if content_type else {}
        data = json.dumps(body) if body is not None else None
        try:
            async with session.request(
                method, self._server + url, params=params, data=data, headers=headers, timeout=timeout
            ) as response:
                return response.status, response.headers, await response.read()
        except (TimeoutError, aiohttp.ClientError) as error:
            raise ApiError(0, "ConnectionFailed", f"{method} {url}: {error!r}") from error

    async def _connect(self, *, fresh: bool) -> aiohttp.ClientSession:
        if self._session is not None and not fresh:
            return self._session
        await self.close()
        info = login(self._settings)
        if info is None:
            raise ApiError(0, "LoginFailed", "found no service account and no kubeconfig to log in with")
        self._server = info.server.rstrip("/")
        # as_http_headers() carries the token or the basic-auth credentials.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()),
            headers={"User-Agent": naming.FIELD_MANAGER, **info.as_http_headers()},
        )
        return self._session


def _seconds(header: str | None) -> float | None:
    """Retry-After in seconds (the API server never sends the HTTP-date form)."""
    try:
        return max(0.0, float(header)) if header is not None else None
    except ValueError:
        return None


def _error(status: int, payload: bytes, *, retry_after: float | None = None) -> ApiError:
    """The API server's Status object, when the body is one."""
    try:
        details = json.loads(payload)
    except ValueError:
        details = None
    if not isinstance(details, dict):
        details = {}
    message = details.get("message") or payload[:500].decode(errors="replace")
    return ApiError(status, details.get("reason") or "Error", message, retry_after=retry_after)
