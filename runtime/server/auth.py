"""Who is calling: the server API key (vLLM's --api-key), tenant keys, a trusted tenant header, the admin token.

Every secret comparison is constant-time (hmac.compare_digest).
"""

from __future__ import annotations

import hmac
import logging
from pathlib import Path
from typing import Mapping

from kvpilot.runtime.server.errors import APIError
from kvpilot.runtime.server.tenants import Tenant, TenantRegistry

logger = logging.getLogger(__name__)

TENANT_HEADER = "x-kvpilot-tenant"


def bearer_token(headers: Mapping[str, str]) -> str | None:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def same_secret(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key")


class Authenticator:
    """Maps a request's headers to its tenant (None: no tenant), or refuses it with 401.

    - Neither an API key nor tenants configured: everyone is let in, without a tenant.
    - `--api-key` only: the Bearer token must be that key.
    - Tenants: the Bearer token must be a tenant's key; the server key, when also configured,
      is accepted too and runs without a tenant (an operator's own calls).
    - `--trust-tenant-header`: a gateway in front has authenticated the caller, and the
      `X-Kvpilot-Tenant` header names the tenant. The header counts only on a request that
      carries the server key, the gateway's credential: without it the header would let anyone
      be any tenant, and a tenant's key could act as another tenant.
    """

    def __init__(self, api_key: str | None, tenants: TenantRegistry | None, trust_tenant_header: bool) -> None:
        if trust_tenant_header and (api_key is None or tenants is None):
            raise ValueError("trusting the tenant header needs the gateway's key (--api-key) and tenants")
        self.api_key = api_key
        self.tenants = tenants
        self.trust_tenant_header = trust_tenant_header

    def authenticate(self, headers: Mapping[str, str]) -> Tenant | None:
        token = bearer_token(headers)
        has_server_key = self.api_key is not None and token is not None and same_secret(token, self.api_key)
        tenant_name = headers.get(TENANT_HEADER)
        if self.trust_tenant_header and tenant_name is not None:
            if not has_server_key:
                raise _unauthorized(f"the {TENANT_HEADER} header is honoured only with the gateway's key "
                                    f"(the server's API key)")
            tenant = self.tenants.by_name(tenant_name)
            if tenant is None:
                raise APIError(401, f"unknown tenant {tenant_name!r}", code="invalid_tenant")
            return tenant
        if self.tenants is not None:
            tenant = self.tenants.by_key(token) if token is not None else None
            if tenant is not None or has_server_key:
                return tenant
            raise _unauthorized("missing or invalid API key")
        if self.api_key is not None and not has_server_key:
            raise _unauthorized("missing or invalid API key")
        return None


class AdminToken:
    """The Bearer token that guards /admin/*, read from a file (a mounted Secret).

    The file is re-read on every check so that a rotated Secret takes effect without a restart.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._read()  # fail at startup, not at the first admin call

    def _read(self) -> str:
        token = self.path.read_text().strip()
        if not token:
            raise ValueError(f"admin token file {self.path} is empty")
        return token

    def matches(self, headers: Mapping[str, str]) -> bool:
        """Whether the request carries the admin token (False when the token is unavailable)."""
        try:
            self.check(headers)
        except APIError:
            return False
        return True

    def check(self, headers: Mapping[str, str]) -> None:
        given = bearer_token(headers)
        try:
            expected = self._read()
        except (OSError, ValueError) as err:
            # The reason (it names the file) is for the server's log, not for the caller.
            logger.error("the admin token is unavailable: %s", err)
            raise APIError(503, "the admin token is unavailable", code="admin_token_unavailable") from err
        if given is None or not same_secret(given, expected):
            raise APIError(401, "missing or invalid admin token", code="invalid_admin_token")
