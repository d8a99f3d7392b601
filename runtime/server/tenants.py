"""Tenants: who may call the server, at which engine priority, and how many sequences at once.

The tenants file is YAML or JSON (the operator renders it from the InferenceEngine resource):

    - name: team-a
      priority: 0                    # engine priority: lower runs first
      apiKeys: ["sk-a-1"]            # inline keys, and/or
      apiKeyFiles: [keys/team-a]     # files holding one key each (Secret volumes); relative
                                     # paths are relative to the tenants file's folder
      maxConcurrentRequests: 8       # sequences in flight (n per request); absent or null: unlimited
      allowRequestPriority: false    # true: a request's own `priority` field wins when given, clamped
                                     # to [priority, +inf): never sooner than the tenant's own

A mapping `{tenants: [...]}` is accepted as well as the bare list. Unknown fields are errors, so
that a typo never silently lifts a limit.

The file and the key files are watched by polling: Kubernetes updates a mounted ConfigMap or
Secret by swapping a symlink, which changes the inode behind the same path.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

logger = logging.getLogger(__name__)

RELOAD_POLL_S = 1.0
_FIELDS = ("name", "priority", "apiKeys", "apiKeyFiles", "maxConcurrentRequests", "allowRequestPriority", "adapters")


class TenantsFileError(ValueError):
    """The tenants file (or a key file it names) is unreadable or invalid; the message says where."""


@dataclass(frozen=True)
class Tenant:
    name: str
    priority: int = 0
    api_keys: tuple[str, ...] = ()
    # None: unlimited.
    max_concurrent_requests: int | None = None
    allow_request_priority: bool = False
    # The LoRA adapters named for this tenant (see the tenants file's `adapters`).
    adapters: tuple[str, ...] = ()

    def engine_priority(self, requested: int | None) -> int:
        """A request may ask to run later than its tenant's priority, never sooner (lower is sooner)."""
        if self.allow_request_priority and requested is not None:
            return max(requested, self.priority)
        return self.priority


@dataclass(frozen=True)
class TenantsConfig:
    tenants: tuple[Tenant, ...]
    # The tenants file and every key file it names: what a reload must watch.
    files: tuple[Path, ...]


def load_tenants(path: Path) -> TenantsConfig:
    try:
        text = path.read_text()
    except OSError as err:
        raise TenantsFileError(f"{path}: cannot read: {err.strerror}") from err
    return parse_tenants(text, path)


def parse_tenants(text: str, path: Path) -> TenantsConfig:
    try:
        document = yaml.safe_load(text)  # YAML is a superset of JSON
    except yaml.YAMLError as err:
        # Not str(err): it quotes the offending line, which may hold an inline API key.
        raise TenantsFileError(f"{path}: not valid YAML or JSON{_where(err)}") from None
    if isinstance(document, dict) and set(document) == {"tenants"}:
        document = document["tenants"]
    if not isinstance(document, list):
        raise TenantsFileError(f"{path}: expected a list of tenants, got {type(document).__name__}")
    tenants, files = [], [path]
    for position, entry in enumerate(document):
        tenant, key_files = _parse_tenant(entry, f"{path}: tenant #{position}", path.parent)
        tenants.append(tenant)
        files.extend(key_files)
    _check_unique(tenants, path)
    return TenantsConfig(tuple(tenants), tuple(files))


def _where(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    return "" if mark is None else f" (line {mark.line + 1}, column {mark.column + 1})"


def _parse_tenant(entry, where: str, base_dir: Path) -> tuple[Tenant, list[Path]]:
    if not isinstance(entry, dict):
        raise TenantsFileError(f"{where}: expected a mapping, got {type(entry).__name__}")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise TenantsFileError(f"{where}: name must be a non-empty string")
    where = f"{where} ({name})"
    unknown = sorted(set(entry) - set(_FIELDS))
    if unknown:
        raise TenantsFileError(f"{where}: unknown field(s) {', '.join(unknown)} (known: {', '.join(_FIELDS)})")
    priority = entry.get("priority", 0)
    if type(priority) is not int:
        raise TenantsFileError(f"{where}: priority must be an integer, got {priority!r}")
    limit = entry.get("maxConcurrentRequests")
    if limit is not None and (type(limit) is not int or limit < 1):
        raise TenantsFileError(f"{where}: maxConcurrentRequests must be a positive integer or null, got {limit!r}")
    allow = entry.get("allowRequestPriority", False)
    if not isinstance(allow, bool):
        raise TenantsFileError(f"{where}: allowRequestPriority must be true or false, got {allow!r}")
    keys = _string_list(entry, "apiKeys", where)
    key_files = [base_dir / p for p in _string_list(entry, "apiKeyFiles", where)]
    keys += [_read_key_file(p, where) for p in key_files]
    if any(not key.strip() for key in keys):
        raise TenantsFileError(f"{where}: apiKeys must not be empty strings")
    adapters = tuple(_string_list(entry, "adapters", where))
    tenant = Tenant(name, priority, tuple(k.strip() for k in keys), limit, allow, adapters)
    return tenant, key_files


def _string_list(entry: dict, field: str, where: str) -> list[str]:
    values = entry.get(field) or []
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise TenantsFileError(f"{where}: {field} must be a list of strings")
    return list(values)


def _read_key_file(path: Path, where: str) -> str:
    try:
        key = path.read_text().strip()
    except OSError as err:
        raise TenantsFileError(f"{where}: cannot read key file {path}: {err.strerror}") from err
    if not key:
        raise TenantsFileError(f"{where}: key file {path} is empty")
    return key


def _check_unique(tenants: list[Tenant], path: Path) -> None:
    names = [t.name for t in tenants]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise TenantsFileError(f"{path}: tenant name(s) used twice: {', '.join(duplicates)}")
    owners: dict[str, str] = {}
    for tenant in tenants:
        for key in tenant.api_keys:
            if owners.setdefault(key, tenant.name) != tenant.name:
                # The key itself is a secret: name the tenants, not the key.
                raise TenantsFileError(f"{path}: an API key is listed twice (tenants {owners[key]}, {tenant.name})")


def _stamp(paths: tuple[Path, ...]) -> tuple:
    """What changes when any of the files is rewritten or swapped (os.stat follows symlinks)."""
    stamps = []
    for path in paths:
        try:
            st = os.stat(path)
            stamps.append((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
        except OSError:
            stamps.append(None)
    return tuple(stamps)


class TenantRegistry:
    """The current tenants, hot-reloaded; in-flight counts are kept by name across reloads."""

    def __init__(self, path: Path, salt_secret: bytes | None = None) -> None:
        self.path = path
        # Tenant cache salts are HMACs under this secret, so no request can name another
        # tenant's salt in its own cache_salt field.
        self._salt_secret = salt_secret or secrets.token_bytes(32)
        self._active: dict[str, int] = {}
        # What this process may run of a limit: all of it, or a router's share where several
        # routers enforce one fleet-wide limit together (router/peers.py).
        self.limit_share: Callable[[int], int] = lambda limit: limit
        config = load_tenants(path)
        self._apply(config, _stamp(config.files))

    def _apply(self, config: TenantsConfig, stamp: tuple) -> None:
        self._config = config
        self._stamp = stamp
        self._by_name = {t.name: t for t in config.tenants}
        self._keys = [(key.encode(), t) for t in config.tenants for key in t.api_keys]

    @property
    def tenants(self) -> tuple[Tenant, ...]:
        return self._config.tenants

    def by_name(self, name: str) -> Tenant | None:
        return self._by_name.get(name)

    def by_key(self, key: str) -> Tenant | None:
        given = key.encode()
        found = None
        # Every key is compared, in constant time, so the time taken says nothing about the keys.
        for candidate, tenant in self._keys:
            if hmac.compare_digest(candidate, given):
                found = tenant
        return found

    def cache_salt(self, tenant: Tenant, request_salt: str | None) -> str:
        """The tenant's own salt, combined with the request's salt when it gives one."""
        message = json.dumps([tenant.name, request_salt]).encode()
        return hmac.new(self._salt_secret, message, "sha256").hexdigest()

    # -- concurrency -----------------------------------------------------------------------------

    def limit(self, tenant: Tenant) -> int | None:
        """The tenant's sequence limit; the current config's, even for a Tenant looked up before a reload."""
        return self._by_name.get(tenant.name, tenant).max_concurrent_requests

    def local_limit(self, tenant: Tenant) -> int | None:
        """The sequences this process may run for the tenant at once: its limit, or its share of it."""
        limit = self.limit(tenant)
        return None if limit is None else self.limit_share(limit)

    def try_admit(self, tenant: Tenant, sequences: int = 1) -> bool:
        """Take `sequences` of the tenant's local limit (each of a request's n choices is one)."""
        limit = self.local_limit(tenant)
        active = self._active.get(tenant.name, 0)
        if limit is not None and active + sequences > limit:
            return False
        self._active[tenant.name] = active + sequences
        return True

    def release(self, tenant: Tenant, sequences: int = 1) -> None:
        remaining = self._active[tenant.name] - sequences
        if remaining:
            self._active[tenant.name] = remaining
        else:
            del self._active[tenant.name]

    def active(self, tenant_name: str) -> int:
        return self._active.get(tenant_name, 0)

    # -- reloading -------------------------------------------------------------------------------

    def reload_if_changed(self) -> bool:
        """Re-read the files if any changed on disk; a broken file keeps the current tenants."""
        stamp = _stamp(self._config.files)
        if stamp == self._stamp:
            return False
        # Remembered even if the load fails, so a broken file is reported once, not every poll.
        self._stamp = stamp
        try:
            config = load_tenants(self.path)
        except TenantsFileError as err:
            logger.error("tenants file not reloaded, keeping the previous %d tenant(s): %s",
                         len(self.tenants), err)
            return False
        self._apply(config, _stamp(config.files))
        logger.info("tenants file reloaded: %d tenant(s)", len(self.tenants))
        return True

    async def watch(self, interval: float = RELOAD_POLL_S) -> None:
        while True:
            await asyncio.sleep(interval)
            self.reload_if_changed()
