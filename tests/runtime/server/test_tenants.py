"""The tenants file: parsing, lookups, salts, concurrency slots and hot reload (no server needed)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from kvpilot.runtime.server.tenants import Tenant, TenantRegistry, TenantsFileError, load_tenants, parse_tenants


def _write(path: Path, content: str | list) -> Path:
    """Replaces the file in one step (a new inode), as a ConfigMap or Secret update does."""
    text = content if isinstance(content, str) else json.dumps(content)
    scratch = path.with_name(path.name + ".new")
    scratch.write_text(text)
    os.replace(scratch, path)
    return path


def test_yaml_file_with_defaults_and_key_files(tmp_path):
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "b").write_text("\n  key-b2 \n")
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(
        "- name: a\n"
        "  apiKeys: [key-a]\n"
        "- name: b\n"
        "  priority: -3\n"
        "  apiKeys: [key-b1]\n"
        "  apiKeyFiles: [keys/b]\n"
        "  maxConcurrentRequests: 4\n"
        "  allowRequestPriority: true\n"
    )
    config = load_tenants(tenants_file)
    assert config.tenants == (
        Tenant("a", 0, ("key-a",), None, False),
        Tenant("b", -3, ("key-b1", "key-b2"), 4, True),
    )
    assert config.files == (tenants_file, tmp_path / "keys" / "b")


def test_json_and_the_mapping_form_are_accepted(tmp_path):
    entries = [{"name": "a", "apiKeys": ["k"]}]
    path = tmp_path / "t.json"
    assert parse_tenants(json.dumps(entries), path).tenants == parse_tenants(json.dumps({"tenants": entries}), path).tenants
    assert parse_tenants("[]", path).tenants == ()


@pytest.mark.parametrize("content, complaint", [
    ("{not: [valid", "not valid YAML"),
    ("name: a", "expected a list"),
    ("[5]", "expected a mapping"),
    ("[{priority: 1}]", "name must be"),
    ("[{name: a, apikeys: [k]}]", "unknown field(s) apikeys"),
    ("[{name: a, priority: high}]", "priority must be an integer"),
    ("[{name: a, priority: true}]", "priority must be an integer"),
    ("[{name: a, maxConcurrentRequests: 0}]", "maxConcurrentRequests must be"),
    ("[{name: a, allowRequestPriority: 'yes'}]", "allowRequestPriority must be"),
    ("[{name: a, apiKeys: k}]", "apiKeys must be a list"),
    ("[{name: a, apiKeys: ['  ']}]", "must not be empty"),
    ("[{name: a, apiKeyFiles: [missing]}]", "cannot read key file"),
    ("[{name: a}, {name: a}]", "used twice: a"),
])
def test_invalid_files_are_refused_with_a_reason(tmp_path, content, complaint):
    with pytest.raises(TenantsFileError) as raised:
        parse_tenants(content, tmp_path / "tenants.yaml")
    assert complaint in str(raised.value)


def test_an_empty_key_file_is_refused(tmp_path):
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(TenantsFileError, match="is empty"):
        parse_tenants("[{name: a, apiKeyFiles: [empty]}]", tmp_path / "tenants.yaml")


def test_a_key_shared_by_two_tenants_is_refused_without_revealing_it(tmp_path):
    with pytest.raises(TenantsFileError) as raised:
        parse_tenants("[{name: a, apiKeys: [s3cret]}, {name: b, apiKeys: [s3cret]}]", tmp_path / "t.yaml")
    assert "a, b" in str(raised.value) and "s3cret" not in str(raised.value)


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(TenantsFileError, match="cannot read"):
        TenantRegistry(tmp_path / "nope.yaml")


def test_a_broken_file_is_reported_by_position_never_by_its_content(tmp_path):
    # A YAML error message quotes the offending line; here that line holds a key.
    with pytest.raises(TenantsFileError) as raised:
        parse_tenants("- name: a\n  apiKeys: [sk-live-123\n  priority: [", tmp_path / "tenants.yaml")
    assert "sk-live-123" not in str(raised.value)
    assert "line " in str(raised.value)


def test_engine_priority_follows_the_tenant_unless_it_allows_the_request_field():
    strict = Tenant("s", priority=3)
    assert strict.engine_priority(None) == 3 and strict.engine_priority(-100) == 3
    relaxed = Tenant("r", priority=3, allow_request_priority=True)
    assert relaxed.engine_priority(None) == 3 and relaxed.engine_priority(100) == 100
    # Clamped: a request never outranks its own tenant.
    assert relaxed.engine_priority(-100) == 3 and relaxed.engine_priority(-2**63) == 3


@pytest.fixture
def registry(tmp_path) -> TenantRegistry:
    path = _write(tmp_path / "tenants.json", [
        {"name": "a", "apiKeys": ["key-a"], "maxConcurrentRequests": 2},
        {"name": "b", "apiKeys": ["key-b"]},
    ])
    return TenantRegistry(path)


def test_lookups(registry):
    assert registry.by_key("key-a").name == "a" and registry.by_key("key-b").name == "b"
    assert registry.by_key("key-c") is None and registry.by_key("") is None
    assert registry.by_name("b").api_keys == ("key-b",) and registry.by_name("c") is None


def test_cache_salts_are_per_tenant_and_keep_the_request_salt(registry):
    a, b = registry.by_name("a"), registry.by_name("b")
    salts = {registry.cache_salt(a, None), registry.cache_salt(b, None), registry.cache_salt(a, "x"),
             registry.cache_salt(b, "x"), registry.cache_salt(a, "y")}
    assert len(salts) == 5
    assert registry.cache_salt(a, "x") == registry.cache_salt(a, "x")
    # Keyed by a per-process secret, not derived from the name alone: no request can name it.
    assert TenantRegistry(registry.path).cache_salt(a, None) != registry.cache_salt(a, None)


def test_concurrency_slots(registry):
    a, b = registry.by_name("a"), registry.by_name("b")
    assert registry.try_admit(a) and registry.try_admit(a)
    assert not registry.try_admit(a)
    assert all(registry.try_admit(b) for _ in range(100))  # no limit
    registry.release(a)
    assert registry.active("a") == 1 and registry.try_admit(a)


def test_reload_keeps_slots_in_flight_and_applies_new_limits(registry):
    a = registry.by_name("a")
    assert registry.try_admit(a) and registry.try_admit(a)
    _write(registry.path, [{"name": "a", "apiKeys": ["key-a"], "maxConcurrentRequests": 3}])
    assert registry.reload_if_changed()
    assert registry.by_name("b") is None
    # The two requests admitted before the reload still count against the new limit.
    assert registry.try_admit(a) and not registry.try_admit(a)
    for _ in range(3):
        registry.release(a)
    assert registry.active("a") == 0


def test_a_removed_tenants_requests_still_release(registry):
    b = registry.by_name("b")
    assert registry.try_admit(b)
    _write(registry.path, [{"name": "a", "apiKeys": ["key-a"]}])
    assert registry.reload_if_changed()
    registry.release(b)
    assert registry.active("b") == 0


def test_unchanged_files_are_not_reloaded(registry):
    assert not registry.reload_if_changed()


def test_a_broken_file_keeps_the_previous_tenants_and_is_reported_once(registry, caplog):
    _write(registry.path, "[{name: a, priority: high}]")
    with caplog.at_level(logging.ERROR):
        assert not registry.reload_if_changed()
        assert not registry.reload_if_changed()
    reports = [r.getMessage() for r in caplog.records if "not reloaded" in r.getMessage()]
    assert len(reports) == 1 and "priority must be an integer" in reports[0]
    assert registry.by_key("key-a").name == "a"
    _write(registry.path, [{"name": "c", "apiKeys": ["key-c"]}])
    assert registry.reload_if_changed() and registry.by_key("key-c").name == "c"


def test_a_kubernetes_style_symlink_swap_is_noticed(tmp_path):
    # A mounted ConfigMap: tenants.json -> ..data/tenants.json, ..data -> a timestamped folder.
    for version, key in [("v1", "key-1"), ("v2", "key-2")]:
        (tmp_path / version).mkdir()
        (tmp_path / version / "tenants.json").write_text(json.dumps([{"name": "a", "apiKeys": [key]}]))
    (tmp_path / "..data").symlink_to("v1")
    (tmp_path / "tenants.json").symlink_to("..data/tenants.json")
    registry = TenantRegistry(tmp_path / "tenants.json")
    assert registry.by_key("key-1") is not None

    (tmp_path / "..data_tmp").symlink_to("v2")
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    assert registry.reload_if_changed()
    assert registry.by_key("key-2") is not None and registry.by_key("key-1") is None


def test_a_rotated_key_file_is_noticed(tmp_path):
    key_file = _write(tmp_path / "key", "old-key\n")
    registry = TenantRegistry(_write(tmp_path / "tenants.json", [{"name": "a", "apiKeyFiles": ["key"]}]))
    assert registry.by_key("old-key") is not None
    _write(key_file, "new-key\n")
    assert registry.reload_if_changed()
    assert registry.by_key("new-key") is not None and registry.by_key("old-key") is None


def test_an_adapter_a_tenant_names_is_that_tenants_and_one_nobody_names_is_everyones(tmp_path):
    path = _write(tmp_path / "tenants.json", [
        {"name": "a", "apiKeys": ["key-a"], "adapters": ["sql", "both"]},
        {"name": "b", "apiKeys": ["key-b"], "adapters": ["both"]},
        {"name": "c", "apiKeys": ["key-c"]},
    ])
    registry = TenantRegistry(path)
    a, b, c = registry.tenants
    assert [registry.may_use_adapter(t, "sql") for t in (a, b, c, None)] == [True, False, False, False]
    assert [registry.may_use_adapter(t, "both") for t in (a, b, c, None)] == [True, True, False, False]
    assert all(registry.may_use_adapter(t, "free") for t in (a, b, c, None))
    with pytest.raises(TenantsFileError, match=r"\(a\): adapters must be a list of strings"):
        parse_tenants(json.dumps([{"name": "a", "adapters": "sql"}]), path)
