"""Servers shared by the end-to-end tests: each start spawns an engine process and loads torch
twice, so the plain server and the real model's server live for the session and the tenant server
for its module (the lifecycle tests start their own, which they end)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvpilot.kernels.cpu import build
from kvpilot.runtime.models.default_model import default_model_path
from server_harness import ADMIN_TOKEN, SERVER_API_KEY, TENANT_KEYS, ServerProcess, start_server


@pytest.fixture(scope="session")
def server(tiny_llama_dir, tmp_path_factory) -> ServerProcess:
    """A plain server: no keys, no tenants, prefix caching on."""
    process = start_server(tiny_llama_dir, tmp_path_factory.mktemp("server"), "--served-model-name", "tiny")
    yield process
    process.stop()


@pytest.fixture(scope="session")
def default_server(smollm2_gguf, tmp_path_factory):
    """The server with no model argument, over a user cache that already holds the model: the real
    model (SmolLM2-135M-Instruct) for every test that needs one served, since its start takes
    seconds of GGUF parsing in each of its two processes."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    target = default_model_path(cache / "kvpilot")
    target.parent.mkdir(parents=True)
    os.link(smollm2_gguf, target)
    # The C kernels stay where the other servers keep them: under a fresh XDG_CACHE_HOME they would
    # all be compiled again, which no test here is about.
    server = start_server(None, tmp_path_factory.mktemp("default-server"), "--max-model-len", "1024",
                          env={"XDG_CACHE_HOME": str(cache), "PIP_NO_INDEX": "1",
                               build.CACHE_ENV: str(build.cache_dir())})
    yield server
    server.stop()


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
