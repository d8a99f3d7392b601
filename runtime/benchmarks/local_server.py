"""A `kvpilot serve` subprocess on 127.0.0.1 for benchmark scripts that measure against a real server."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

STARTUP_TIMEOUT_S = 300.0


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
def local_servers(model_dir: str, *flag_sets: list[str], env: dict[str, str] | None = None) -> Iterator[list[str]]:
    """One `kvpilot serve` per flag set, all started at once (their start-ups overlap); yields
    their base URLs, in order, once every one is healthy."""
    servers, urls = [], []
    try:
        for flags in flag_sets:
            port = _free_port()
            servers.append(subprocess.Popen(
                [sys.executable, "-m", "kvpilot.runtime.cli", "serve", model_dir, "--host", "127.0.0.1",
                 "--port", str(port), *flags],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})},
            ))
            urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for server, base_url in zip(servers, urls):
            _wait_healthy(server, base_url, deadline)
        yield urls
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait(timeout=60)


def _wait_healthy(server: subprocess.Popen, base_url: str, deadline: float) -> None:
    while True:
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server at {base_url} did not start")
        time.sleep(0.5)
