"""A small asyncio Kubernetes client for the two calls the router makes: list, and watch.

In a pod it logs in as the pod's service account; elsewhere (development, tests) from a
kubeconfig. The operator logs in through kopf, which the runtime image does not carry.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_LIST_TIMEOUT = aiohttp.ClientTimeout(total=30)
# A watch that outlives its server-side timeout by this much is taken for a dead connection.
_WATCH_GRACE_S = 30


class ApiError(Exception):
    """A failed call; `status` is 0 where no HTTP answer came back."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status


@dataclass(frozen=True)
class Login:
    """Where the API server is, and how to prove who we are to it."""

    server: str
    # The pod's own namespace, or the kubeconfig context's: where a Service named alone is looked for.
    namespace: str = "default"
    token: str | None = None
    # Read before every call: the kubelet rotates a service account's token while the pod runs.
    token_file: Path | None = None
    ca_file: str | None = None
    ca_data: str | None = None
    client_cert_pem: bytes | None = None
    verify: bool = True

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_file, cadata=self.ca_data)
        if not self.verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if self.client_cert_pem:
            # load_cert_chain reads only files; the file lives no longer than the call.
            with tempfile.NamedTemporaryFile() as pem:
                pem.write(self.client_cert_pem)
                pem.flush()
                context.load_cert_chain(pem.name)
        return context

    def headers(self) -> dict[str, str]:
        token = self.token_file.read_text().strip() if self.token_file else self.token
        return {"Authorization": f"Bearer {token}"} if token else {}


def in_cluster_login(account: Path = SERVICE_ACCOUNT) -> Login:
    """The pod's service account, and the API server's address that the kubelet puts in the environment."""
    host = os.environ["KUBERNETES_SERVICE_HOST"]
    if ":" in host:
        host = f"[{host}]"
    return Login(
        server=f"https://{host}:{os.environ['KUBERNETES_SERVICE_PORT']}",
        namespace=(account / "namespace").read_text().strip(),
        token_file=account / "token",
        ca_file=str(account / "ca.crt"),
    )


def kubeconfig_login(path: Path | None = None) -> Login:
    """The current context of a kubeconfig ($KUBECONFIG, else ~/.kube/config): tokens, token
    files and client certificates; exec plugins are not run."""
    path = path or Path(os.environ.get("KUBECONFIG") or Path.home() / ".kube" / "config")
    config = yaml.safe_load(path.read_text())
    context = _named(config, "contexts", config["current-context"])["context"]
    cluster = _named(config, "clusters", context["cluster"])["cluster"]
    user = _named(config, "users", context["user"])["user"] or {}
    here = path.parent
    return Login(
        server=cluster["server"].rstrip("/"),
        namespace=context.get("namespace", "default"),
        token=user.get("token"),
        token_file=here / user["tokenFile"] if "tokenFile" in user else None,
        ca_file=str(here / cluster["certificate-authority"]) if "certificate-authority" in cluster else None,
        ca_data=_decoded(cluster.get("certificate-authority-data")),
        client_cert_pem=_client_cert_pem(user, here),
        verify=not cluster.get("insecure-skip-tls-verify", False),
    )


def default_login() -> Login:
    """In a pod, its service account; elsewhere, the kubeconfig."""
    return in_cluster_login() if "KUBERNETES_SERVICE_HOST" in os.environ else kubeconfig_login()


class KubeClient:
    def __init__(self, login: Login) -> None:
        self.login = login
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def list(self, path: str, *, label_selector: str) -> dict[str, Any]:
        """The collection at `path` whose objects match the selector, with its resourceVersion."""
        params = {"labelSelector": label_selector}
        try:
            async with self._connected().get(self.login.server + path, params=params,
                                             headers=self.login.headers(), timeout=_LIST_TIMEOUT) as response:
                await _raise_for_status(response)
                return await response.json()
        except (OSError, TimeoutError, aiohttp.ClientError, ValueError) as error:
            raise ApiError(0, f"GET {path}: {error!r}") from error

    async def watch(
        self, path: str, *, label_selector: str, resource_version: str, timeout_s: int
    ) -> AsyncIterator[dict[str, Any]]:
        """The events after `resource_version`, bookmarks included, until the server ends the
        watch (after `timeout_s`). An ERROR event is raised as an ApiError of its code (410: the
        version is too old to watch from, so list again)."""
        params = {
            "labelSelector": label_selector, "watch": "true", "allowWatchBookmarks": "true",
            "resourceVersion": resource_version, "timeoutSeconds": str(timeout_s),
        }
        timeout = aiohttp.ClientTimeout(total=timeout_s + _WATCH_GRACE_S)
        try:
            async with self._connected().get(self.login.server + path, params=params,
                                             headers=self.login.headers(), timeout=timeout) as response:
                await _raise_for_status(response)
                async for line in _lines(response.content):
                    event = json.loads(line)
                    if event.get("type") == "ERROR":
                        status = event.get("object") or {}
                        raise ApiError(status.get("code", 0), status.get("message", "the watch failed"))
                    yield event
        except (OSError, TimeoutError, aiohttp.ClientError, ValueError) as error:
            raise ApiError(0, f"watch {path}: {error!r}") from error

    def _connected(self) -> aiohttp.ClientSession:
        if self._session is None:
            ssl_context = self.login.ssl_context() if self.login.server.startswith("https:") else None
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=ssl_context) if ssl_context else None,
                headers={"User-Agent": "kvpilot-router"},
            )
        return self._session


async def _raise_for_status(response: aiohttp.ClientResponse) -> None:
    if response.status >= 400:
        payload = await response.read()
        try:
            message = json.loads(payload).get("message", "")
        except (ValueError, AttributeError):
            message = payload[:500].decode(errors="replace")
        raise ApiError(response.status, message)


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """Newline-separated chunks of a stream. aiohttp's own line reader refuses a line longer than
    its buffer, and one event carries a whole EndpointSlice (up to a hundred endpoints)."""
    pending = b""
    async for chunk in content.iter_any():
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.strip():
                yield line
    if pending.strip():
        yield pending


def _named(config: Mapping[str, Any], section: str, name: str) -> dict[str, Any]:
    return next(entry for entry in config[section] if entry["name"] == name)


def _decoded(data: str | None) -> str | None:
    return base64.b64decode(data).decode() if data else None


def _client_cert_pem(user: Mapping[str, Any], here: Path) -> bytes | None:
    """The user's certificate and key as one PEM, from files or inline data."""
    parts = []
    for field in ("client-certificate", "client-key"):
        if f"{field}-data" in user:
            parts.append(base64.b64decode(user[f"{field}-data"]))
        elif field in user:
            parts.append((here / user[field]).read_bytes())
    return b"\n".join(parts) or None
