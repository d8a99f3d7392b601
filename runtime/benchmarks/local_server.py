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
    """`kvpilot serve model_dir *flags` on a free port; yields its base URL once /health answers 200,
    and stops the server on the way out. SystemExit if it exits or does not become healthy. `env`
    adds to (or overrides) this process's environment for the server."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "kvpilot.runtime.cli", "serve", model_dir, "--host", "127.0.0.1",
         "--port", str(port), *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})},
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        yield base_url
    finally:
        server.terminate()
        server.wait(timeout=60)
