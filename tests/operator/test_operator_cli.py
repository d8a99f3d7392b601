"""`kvpilot operator`: its flags, and the command itself running against the emulated API server."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.operator.leader_election import LeaderElection, LeaseSettings
from kvpilot.runtime import cli
from operator_harness import WAIT_TIMEOUT, cluster, created, eventually, free_port, run
from operator_process import healthy, start


def test_a_namespace_scope_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["operator"])
    assert exit_info.value.code == 2
    assert "one of the arguments --namespace/-n --all-namespaces/-A is required" in capsys.readouterr().err


def test_namespace_patterns_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["operator", "--namespace", "team-*"])
    assert exit_info.value.code == 2
    assert "must be a namespace name" in capsys.readouterr().err


def test_a_metrics_endpoint_that_is_no_http_address_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for endpoint in ("0.0.0.0:8081", "https://0.0.0.0:8081/metrics", "http://0.0.0.0/metrics", "http://:x/metrics"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["operator", "-A", "--metrics-endpoint", endpoint])
        assert exit_info.value.code == 2
        assert "argument --metrics-endpoint: must look like http://HOST:PORT/PATH" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "expected"), [
    (["-n", "ml", "--namespace", "serving"],
     {"namespaces": ["ml", "serving"], "clusterwide": False, "liveness_endpoint": "http://0.0.0.0:8080/healthz",
      "metrics_endpoint": "http://0.0.0.0:8081/metrics", "log_level": "info", "log_format": "full",
      "leader_election": None}),
    (["--all-namespaces", "--liveness-endpoint", "", "--metrics-endpoint", "", "--log-level", "debug",
      "--log-format", "json", "--leader-elect", "--leader-elect-resource-namespace", "ops",
      "--leader-elect-retry-period", "1"],
     {"namespaces": [], "clusterwide": True, "liveness_endpoint": None, "metrics_endpoint": None,
      "log_level": "debug", "log_format": "json",
      "leader_election": LeaderElection("kvpilot-operator", "ops", LeaseSettings(15, 10, 1))}),
])
def test_flags_reach_the_operator(monkeypatch: pytest.MonkeyPatch, argv: list[str], expected: dict[str, Any]) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr("kvpilot.operator.run.run_operator", lambda **kwargs: calls.append(kwargs))
    assert cli.main(["operator", *argv]) == 0
    assert calls == [expected]


@pytest.mark.parametrize(("argv", "expected"), [
    (["--leader-elect"], "--leader-elect needs --leader-elect-resource-namespace outside a pod"),
    (["--leader-elect", "--leader-elect-resource-namespace", "ops", "--leader-elect-renew-deadline", "15"],
     "must be shorter than the lease duration"),
    (["--leader-elect-retry-period", "0"], "must be a positive number"),
])
def test_lease_settings_that_cannot_work_are_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str,
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["operator", "-n", "ml", *argv])
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_the_operator_never_imports_torch() -> None:
    code = "import sys, kvpilot.operator.run, kvpilot.runtime.cli; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.timeout(90)
def test_the_command_reconciles_and_serves_liveness_and_its_metrics(tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    log = tmp_path / "operator.log"

    async def scenario() -> None:
        async with cluster(tmp_path) as k:
            process = await start(log, "--liveness-endpoint", f"http://127.0.0.1:{port}/healthz",
                                  "--metrics-endpoint", f"http://127.0.0.1:{metrics_port}/metrics")
            try:
                await eventually(lambda: healthy(port), "the liveness endpoint", timeout=30)
                await created(k)
                # The engine's replicas as its watch events show them, and the pass that applied it.
                shown = await eventually(lambda: _metrics_where(
                    metrics_port, lambda found: found.get(("kvpilot:operator_reconciles_total", "success"), 0) >= 1
                    and found.get(("kvpilot:engine_desired_replicas", "qwen")) == 2), "the operator's metrics",
                    timeout=30)
                assert shown[("kvpilot:operator_reconciles_total", "error")] == 0
            finally:
                if process.returncode is None:
                    process.send_signal(signal.SIGTERM)
                await asyncio.wait_for(process.wait(), WAIT_TIMEOUT)
            assert process.returncode == 0, log.read_text()[-2000:]

    run(scenario())


async def _metrics_where(port: int, holds: Callable[[dict[tuple[str, str], float]], bool]):
    """The operator's metrics, as (name, engine or result) -> value, once `holds` of them."""
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
                page = await response.text()
    except aiohttp.ClientError:
        return None
    found = {(s.name, s.labels.get("engine") or s.labels.get("result", "")): s.value
             for family in text_string_to_metric_families(page) for s in family.samples}
    return found if holds(found) else None
