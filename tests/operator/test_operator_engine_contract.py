"""What the operator renders is what the engine accepts: its `kvpilot serve` flags and its tenants file."""

from __future__ import annotations

import argparse
import base64
from pathlib import Path

import pytest
import yaml

from crd_validation import engine_schema
from inference_engines import ADMIN_TOKEN, BATCH_KEY, CACHE_SALT, FULL_SPEC, PROD_KEY, TENANT_KEYS, engine, example
from kvpilot.operator import render
from kvpilot.runtime import cli
from kvpilot.runtime.config import ATTENTION_BACKENDS


def parsed_serve_args(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> argparse.Namespace:
    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(cli, "_serve", lambda parsed, parser: seen.append(parsed) or 0)
    assert cli.main(["serve", *args]) == 0
    (parsed,) = seen
    return parsed


def test_the_engine_accepts_the_rendered_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed = parsed_serve_args(monkeypatch, render.serve_args(engine(FULL_SPEC)))
    assert parsed.model_dir == "/var/lib/kvpilot/model"
    assert parsed.served_model_name == "llama-3-8b"
    assert (parsed.host, parsed.port) == ("0.0.0.0", 8000)
    assert parsed.tensor_parallel_size == 2
    assert (parsed.max_num_seqs, parsed.max_num_batched_tokens, parsed.max_model_len) == (128, 8192, 8192)
    assert parsed.enable_prefix_caching is False
    assert parsed.scheduling_policy == "priority"
    assert parsed.shutdown_timeout == 30
    assert parsed.tenants_file == Path("/etc/kvpilot/tenants.yaml")
    assert parsed.seed == 7
    assert parsed.gpu_memory_utilization == FULL_SPEC["engine"]["gpuMemoryUtilization"]
    assert parsed.attention_backend == "triton"


def test_the_engine_accepts_the_flags_of_an_auto_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = {**FULL_SPEC, "scheduling": {**FULL_SPEC["scheduling"], "policy": "auto"}}
    parsed = parsed_serve_args(monkeypatch, render.serve_args(engine(spec)))
    assert parsed.scheduling_policy_file == Path("/var/run/kvpilot/scheduling/policy")
    assert parsed.admin_token_file == Path("/var/run/kvpilot/admin/token")


def test_the_engine_accepts_the_examples_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed_serve_args(monkeypatch, render.serve_args(example()))


def test_the_engine_reads_the_rendered_tenants_file(tmp_path: Path) -> None:
    tenants = pytest.importorskip("kvpilot.runtime.server.tenants")
    rendered = {c["metadata"]["name"]: c for c in render.children(
        engine(), tenant_keys=TENANT_KEYS, admin_token=ADMIN_TOKEN, cache_salt=CACHE_SALT, service_monitor=False)}
    # Lay out the two volumes as the kubelet would, under tmp_path instead of /.
    keys_dir = tmp_path / render.TENANT_KEYS_DIR.lstrip("/")
    keys_dir.mkdir(parents=True)
    for name, value in rendered["llama-tenant-keys"]["data"].items():
        (keys_dir / name).write_bytes(base64.b64decode(value))
    text = rendered["llama-config"]["data"]["tenants.yaml"].replace(render.TENANT_KEYS_DIR, str(keys_dir))
    path = tmp_path / "tenants.yaml"

    config = tenants.parse_tenants(text, path)
    by_name = {t.name: t for t in config.tenants}
    assert by_name["prod"].api_keys == (PROD_KEY,)
    assert by_name["batch"].api_keys == (BATCH_KEY,)
    # CRD priority 100 (more important) runs before CRD priority -10 in the engine's lower-first order.
    assert by_name["prod"].priority < by_name["batch"].priority
    assert by_name["prod"].max_concurrent_requests == 32
    assert by_name["batch"].allow_request_priority is True
    assert set(config.files) == {path, keys_dir / "prod", keys_dir / "batch"}


def test_the_crd_offers_exactly_the_engines_attention_backends() -> None:
    # A backend the engine gains must be reachable from a spec, and the CRD must not admit one
    # the engine would refuse at start-up.
    enum = engine_schema()["properties"]["spec"]["properties"]["engine"]["properties"]["attentionBackend"]["enum"]
    assert enum == list(ATTENTION_BACKENDS)


def test_the_engine_accepts_the_lora_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = {**FULL_SPEC, "adapters": [{"name": "sql", "source": "adapters/sql"}],
            "engine": {**FULL_SPEC["engine"], "maxLoras": 4, "maxLoraRank": 64, "maxCpuLoras": 8}}
    parsed = parsed_serve_args(monkeypatch, render.serve_args(engine(spec)))
    assert (parsed.enable_lora, parsed.max_loras, parsed.max_lora_rank, parsed.max_cpu_loras) == (True, 4, 64, 8)


def test_the_engine_reads_each_tenants_adapters(tmp_path: Path) -> None:
    tenants = pytest.importorskip("kvpilot.runtime.server.tenants")
    spec = {**FULL_SPEC, "adapters": [{"name": "sql", "source": "adapters/sql"}]}
    spec["scheduling"] = {**spec["scheduling"],
                          "tenants": [{**spec["scheduling"]["tenants"][0], "adapters": ["sql"]}]}
    rendered = render.tenants(engine(spec)["spec"], {})
    (tenant,) = tenants.parse_tenants(yaml.safe_dump(rendered), tmp_path / "tenants.yaml").tenants
    assert tenant.adapters == ("sql",)
