"""Who gets in: the server key, tenant keys, the trusted tenant header and the admin token."""

from __future__ import annotations

import json

import pytest

from kvpilot.runtime.server.auth import AdminToken, Authenticator, bearer_token
from kvpilot.runtime.server.errors import APIError
from kvpilot.runtime.server.tenants import TenantRegistry


def _bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


@pytest.fixture
def tenants(tmp_path) -> TenantRegistry:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps([{"name": "a", "apiKeys": ["key-a"]}, {"name": "b", "apiKeys": ["key-b"]}]))
    return TenantRegistry(path)


def _refused(authenticator: Authenticator, headers: dict[str, str]) -> APIError:
    with pytest.raises(APIError) as raised:
        authenticator.authenticate(headers)
    assert raised.value.status_code == 401
    return raised.value


@pytest.mark.parametrize("header, token", [
    ("Bearer abc", "abc"), ("bearer abc ", "abc"), ("Basic abc", None), ("Bearer ", None), ("abc", None),
])
def test_bearer_token(header, token):
    assert bearer_token({"authorization": header}) == token
    assert bearer_token({}) is None


def test_without_keys_everyone_gets_in_without_a_tenant():
    assert Authenticator(None, None, False).authenticate({}) is None


def test_server_key_only():
    auth = Authenticator("sk", None, False)
    assert auth.authenticate(_bearer("sk")) is None
    assert _refused(auth, {}).code == "invalid_api_key"
    _refused(auth, _bearer("sk2"))


def test_tenant_keys_name_the_tenant(tenants):
    auth = Authenticator(None, tenants, False)
    assert auth.authenticate(_bearer("key-b")).name == "b"
    _refused(auth, {})
    _refused(auth, _bearer("key-c"))


def test_with_tenants_the_server_key_runs_without_a_tenant(tenants):
    auth = Authenticator("sk", tenants, False)
    assert auth.authenticate(_bearer("sk")) is None
    assert auth.authenticate(_bearer("key-a")).name == "a"
    _refused(auth, _bearer("nope"))


def test_the_tenant_header_counts_only_when_trusted(tenants):
    header = {"x-kvpilot-tenant": "b"}
    assert Authenticator("sk", tenants, True).authenticate({**header, **_bearer("sk")}).name == "b"
    # Untrusted, the header is ignored and the key decides.
    untrusted = Authenticator("sk", tenants, False)
    _refused(untrusted, header)
    assert untrusted.authenticate({**header, **_bearer("key-a")}).name == "a"


def test_trusting_the_header_needs_the_gateway_key(tenants):
    # Without a gateway credential the header would be the whole authentication.
    with pytest.raises(ValueError, match="--api-key"):
        Authenticator(None, tenants, True)


def test_a_trusted_header_counts_only_with_the_gateway_key(tenants):
    auth = Authenticator("sk", tenants, True)
    assert auth.authenticate({"x-kvpilot-tenant": "b", **_bearer("sk")}).name == "b"
    _refused(auth, {"x-kvpilot-tenant": "b"})
    # A tenant's key never lets the header switch it to another tenant, nor to its own name.
    _refused(auth, {"x-kvpilot-tenant": "b", **_bearer("key-a")})
    _refused(auth, {"x-kvpilot-tenant": "a", **_bearer("key-a")})
    # Without the header, a tenant's key still names its tenant.
    assert auth.authenticate(_bearer("key-a")).name == "a"
    assert _refused(auth, {"x-kvpilot-tenant": "zz", **_bearer("sk")}).code == "invalid_tenant"


def test_admin_token_is_checked_and_rereads_its_file(tmp_path):
    path = tmp_path / "admin"
    path.write_text("first\n")
    token = AdminToken(path)
    token.check(_bearer("first"))
    for headers in [{}, _bearer("second")]:
        with pytest.raises(APIError) as raised:
            token.check(headers)
        assert raised.value.status_code == 401
    path.write_text("second")  # a rotated Secret
    token.check(_bearer("second"))
    path.unlink()
    with pytest.raises(APIError) as raised:
        token.check(_bearer("second"))
    assert raised.value.status_code == 503
    # The caller is not told where the token lives.
    assert str(tmp_path) not in raised.value.message


def test_admin_token_file_must_exist_and_hold_a_token(tmp_path):
    with pytest.raises(OSError):
        AdminToken(tmp_path / "missing")
    (tmp_path / "blank").write_text(" \n")
    with pytest.raises(ValueError, match="empty"):
        AdminToken(tmp_path / "blank")
