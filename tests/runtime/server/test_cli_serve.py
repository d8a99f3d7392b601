"""`kvpilot serve` arguments: every mistake is a usage error (exit 2), and an address that cannot be
listened on an error (exit 1), before any engine starts."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvpilot.runtime import cli
from kvpilot.runtime.server import launcher
from kvpilot.runtime.server.limits import ServerLimits

from server_harness import HTTP_TIMEOUT_S, engine_core_pid, start_server


def _usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as raised:
        cli.main(["serve", *argv])
    assert raised.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, complaint", [
    (["--tensor-parallel-size", "0"], "argument --tensor-parallel-size: must be a positive integer"),
    (["--trust-tenant-header"], "argument --trust-tenant-header: needs --tenants-file"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: must be a positive integer"),
    (["--scheduling-policy", "lifo"], "argument --scheduling-policy: invalid choice"),
    (["--shutdown-timeout", "-1"], "argument --shutdown-timeout: must be a non-negative number"),
    (["--dtype", "int8"], "argument --dtype: invalid choice"),
    (["--enable-auto-tool-choice"], "argument --enable-auto-tool-choice: needs --tool-call-parser"),
    (["--tool-call-parser", "mistral"], "argument --tool-call-parser: invalid choice: 'mistral' (choose from 'hermes', 'llama3_json')"),
    (["--port", "70000"], "argument --port: must be a TCP port, 1 to 65535, got 70000"),
    (["/no/such/model"], "argument MODEL: no such folder or file: /no/such/model"),
    # What `vllm serve` takes, which fetches it.
    (["Qwen/Qwen2.5-0.5B-Instruct"], "`hf download Qwen/Qwen2.5-0.5B-Instruct --local-dir DIR`, then serve DIR"),
    # With serve's usage line, which lists its flags.
    (["--no-such-flag"], "kvpilot serve: error: unrecognized arguments: --no-such-flag"),
])
def test_bad_flags(capsys, argv, complaint):
    assert complaint in _usage_error(capsys, *argv)


@pytest.mark.parametrize("argv, complaint", [
    (["--max-request-body-bytes", "0"], "argument --max-request-body-bytes: must be a positive integer"),
    (["--max-n", "x"], "argument --max-n: invalid positive_int value"),
    (["--stream-stall-timeout", "0"], "argument --stream-stall-timeout: must be a positive number"),
])
def test_bad_limits(capsys, argv, complaint):
    assert complaint in _usage_error(capsys, *argv)


def test_a_trusted_tenant_header_needs_the_gateway_key(capsys, tmp_path):
    (tmp_path / "tenants.yaml").write_text("[{name: a, apiKeys: [k]}]")
    error = _usage_error(capsys, str(tmp_path), "--tenants-file", str(tmp_path / "tenants.yaml"),
                         "--trust-tenant-header")
    assert "argument --trust-tenant-header: needs --api-key" in error


def test_bad_files_are_named(capsys, tmp_path):
    (tmp_path / "tenants.yaml").write_text("[{name: a, priority: high}]")
    error = _usage_error(capsys, str(tmp_path), "--tenants-file", str(tmp_path / "tenants.yaml"))
    assert "argument --tenants-file:" in error and "priority must be an integer" in error
    error = _usage_error(capsys, str(tmp_path), "--admin-token-file", str(tmp_path / "missing"))
    assert "argument --admin-token-file:" in error
    error = _usage_error(capsys, str(tmp_path), "--scheduling-policy-file", str(tmp_path / "missing"))
    assert "argument --scheduling-policy-file:" in error and "No such file" in error
    (tmp_path / "policy").write_text("lifo\n")
    error = _usage_error(capsys, str(tmp_path), "--scheduling-policy-file", str(tmp_path / "policy"))
    assert "argument --scheduling-policy-file:" in error and "unknown scheduling policy 'lifo'" in error


def test_a_folder_without_a_model_is_refused(capsys, tmp_path):
    assert "no config.json" in _usage_error(capsys, str(tmp_path))


def test_engine_limits_are_checked_before_the_engine_starts(capsys, tiny_llama_dir):
    # The flag's choices come from the block_size setting itself.
    assert "argument --block-size: invalid choice: 3" in _usage_error(
        capsys, str(tiny_llama_dir), "--block-size", "3")
    # Named by the flag, not by the setting's Python name.
    assert "argument --max-model-len: 100000 exceeds the model's max_position_embeddings" in _usage_error(
        capsys, str(tiny_llama_dir), "--max-model-len", "100000")
    assert "argument --tensor-parallel-size: 3 does not divide" in _usage_error(
        capsys, str(tiny_llama_dir), "--tensor-parallel-size", "3")


@pytest.mark.parametrize("host, complaint", [
    ("127.0.0.1", "Address already in use: another process is listening there, pick another --port"),
    ("192.0.2.1", "Cannot assign requested address"),  # TEST-NET-1: no interface of this machine
])
def test_an_address_that_cannot_be_listened_on_fails_before_the_engine_starts(capsys, monkeypatch, tiny_llama_dir,
                                                                               host, complaint):
    def no_engine(*args, **kwargs):
        pytest.fail("the engine was started for an address that cannot be listened on")

    monkeypatch.setattr(launcher, "AsyncLLM", no_engine)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert cli.main(["serve", str(tiny_llama_dir), "--host", host, "--port", str(port)]) == 1
    error = capsys.readouterr().err
    assert f"kvpilot serve: error: cannot listen on {host}:{port}: {complaint}" in error


def test_the_console_script_and_python_m_both_run_the_cli():
    script = Path(sys.executable).with_name("kvpilot")
    result = subprocess.run([str(script), "serve", "--max-num-seqs", "0"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "--max-num-seqs" in result.stderr
    result = subprocess.run([sys.executable, "-m", "kvpilot.runtime.cli", "serve", "--help"], capture_output=True,
                            text=True, timeout=120, env={"PATH": ""})
    assert result.returncode == 0 and "--served-model-name" in result.stdout


def test_ctrl_c_while_the_model_loads_exits_130_without_a_traceback(capsys, monkeypatch, tiny_llama_dir):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(launcher, "run_server", interrupted)
    assert cli.main(["serve", str(tiny_llama_dir)]) == 130
    assert capsys.readouterr().err == "kvpilot serve: interrupted\n"


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_only_the_engine_process_loads_torch(server):
    """The API server tokenizes and streams: torch in it would cost every start its import (~1.4 s)."""
    answer = httpx.post(f"{server.base_url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                        timeout=HTTP_TIMEOUT_S)
    assert answer.status_code == 200, answer.text
    assert _maps_torch(engine_core_pid(server.pid))
    assert not _maps_torch(server.pid)


def test_make_serve_takes_another_port_and_host():
    # What the README tells a user whose port 8000 is taken; -n prints the command without running it.
    repo = Path(__file__).parents[3]

    def serve_command(*variables: str, env: dict[str, str] | None = None) -> str:
        result = subprocess.run(["make", "-n", "-s", "serve", *variables], cwd=repo, capture_output=True, text=True,
                                timeout=120, env={**os.environ, **(env or {})})
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert "kvpilot serve --host 0.0.0.0 --port 8123" in serve_command("PORT=8123", "HOST=0.0.0.0")
    # A PORT or HOST the shell exports for something else does not move it.
    assert "kvpilot serve --host 127.0.0.1 --port 8000" in serve_command(env={"PORT": "3000", "HOST": "example"})
