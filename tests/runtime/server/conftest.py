"""Servers shared by the end-to-end tests: each start spawns an engine process and loads torch
twice, so the plain server lives for the session and the tenant server for its module (the
lifecycle tests start their own, which they end)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server_harness import ADMIN_TOKEN, SERVER_API_KEY, TENANT_KEYS, ServerProcess, start_server


@pytest.fixture(scope="session")
def server(tiny_llama_dir, tmp_path_factory) -> ServerProcess:
    """A plain server: no keys, no tenants, prefix caching on."""
    process = start_server(tiny_llama_dir, tmp_path_factory.mktemp("server"), "--served-model-name", "tiny")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def tenants_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tenants")
    (folder / "keys").mkdir()
    (folder / "keys" / "limited").write_text(f"  {TENANT_KEYS['limited']}\n")
    (folder / "admin-token").write_text(ADMIN_TOKEN + "\n")
    tenants = [
        {"name": "gold", "priority": 0, "apiKeys": [TENANT_KEYS["gold"]]},
        {"name": "bronze", "priority": 10, "apiKeys": [TENANT_KEYS["bronze"]]},
        {"name": "flex", "priority": 5, "apiKeys": [TENANT_KEYS["flex"]], "allowRequestPriority": True},
        {"name": "limited", "priority": 5, "apiKeyFiles": ["keys/limited"], "maxConcurrentRequests": 1},
    ]
    (folder / "tenants.json").write_text(json.dumps(tenants))
    return folder


@pytest.fixture(scope="module")
def tenant_server(tiny_llama_dir, tenants_dir, tmp_path_factory) -> ServerProcess:
    """Tenants, a server key, an admin token, a trusted tenant header; one sequence at a time, so
    that queued requests start in an order the tests can observe."""
    process = start_server(
        tiny_llama_dir, tmp_path_factory.mktemp("tenant-server"),
        "--served-model-name", "tiny", "--max-num-seqs", "1",
        "--tenants-file", str(tenants_dir / "tenants.json"), "--api-key", SERVER_API_KEY,
        "--admin-token-file", str(tenants_dir / "admin-token"), "--trust-tenant-header",
    )
    yield process
    process.stop()
