"""A `kvpilot serve` subprocess on 127.0.0.1 for benchmark scripts that measure against a real server.

Each server's stdout and stderr go to a log file: when the server does not start, exits early,
or the benchmark fails while it runs, the error names the file, which is kept, and ends with its
last lines, so that a failed run says why the server refused, closed or died.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 300.0
LOG_TAIL_LINES = 40
ACCESS_LINE = re.compile(r'INFO: +[\d.:]+ - "')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(model_dir: str, *flags: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """`kvpilot serve model_dir *flags` on a free port (with `env` added to this process's
    environment); yields its base URL once /health answers 200, and stops the server on the way
    out. SystemExit if it exits or does not become healthy."""
    with local_servers(model_dir, list(flags), env=env) as (base_url,):
        yield base_url


@contextlib.contextmanager
def local_servers(model_dir: str, *flag_sets: list[str], env: dict[str, str] | None = None,
                  subcommand: str = "serve") -> Iterator[list[str]]:
    """One `kvpilot serve` (or `kvpilot router`: `subcommand`) per flag set, all started at once (their start-ups overlap); yields
    their base URLs, in order, once every one is healthy. An exception or SystemExit from the
    caller's block is re-raised with each server's log (its path, whether it is still alive, its
    last lines)."""
    servers, urls, logs = [], [], []
    failed = True
    log_dir = Path(tempfile.mkdtemp(prefix="kvpilot-serve-logs-"))
    try:
        for flags in flag_sets:
            port = _free_port()
            log = log_dir / f"{subcommand}-{port}.log"
            with log.open("wb") as sink:  # the child keeps its own descriptor
                servers.append(subprocess.Popen(
                    [sys.executable, "-m", "kvpilot.runtime.cli", subcommand, model_dir, "--host", "127.0.0.1",
                     "--port", str(port), *flags],
                    stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                ))
            urls.append(f"http://127.0.0.1:{port}")
            logs.append(log)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for server, base_url, log in zip(servers, urls, logs):
            _wait_healthy(subcommand, server, base_url, log, deadline)
        try:
            yield urls
        except SystemExit as error:  # its message is all Python prints of it
            raise SystemExit(f"{error.code}\n{_reports(subcommand, servers, logs)}") from None
        except Exception as error:
            error.add_note(_reports(subcommand, servers, logs))
            raise
        failed = False
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait(timeout=60)
        if not failed:  # the logs are kept for failures only
            shutil.rmtree(log_dir, ignore_errors=True)


def _wait_healthy(subcommand: str, server: subprocess.Popen, base_url: str, log: Path, deadline: float) -> None:
    while True:
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server at {base_url} did not start\n{_report(subcommand, server, log)}")
        time.sleep(0.5)


def _reports(subcommand: str, servers: list[subprocess.Popen], logs: list[Path]) -> str:
    return "\n".join(_report(subcommand, server, log) for server, log in zip(servers, logs))


def _report(subcommand: str, server: subprocess.Popen, log: Path) -> str:
    code = server.poll()
    state = "still running" if code is None else f"exited with status {code}"
    # uvicorn's access lines say only that earlier requests were answered.
    lines = [line for line in log.read_text(errors="replace").splitlines()
             if not ACCESS_LINE.match(line)][-LOG_TAIL_LINES:]
    return "\n".join([f"kvpilot {subcommand} ({state}); its log: {log}", *(f"  | {line}" for line in lines)])
