"""Start real `kvpilot serve` processes on 127.0.0.1 and talk to them; every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

STARTUP_TIMEOUT_S = 180.0
EXIT_TIMEOUT_S = 60.0
# Client-side bound on any single HTTP call.
HTTP_TIMEOUT_S = 120.0
TENANT_KEYS = {"gold": "gold-key", "bronze": "bronze-key", "flex": "flex-key", "limited": "limited-key"}
SERVER_API_KEY = "server-key"
ADMIN_TOKEN = "admin-token"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    process: subprocess.Popen
    base_url: str
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_exit(self, timeout: float = EXIT_TIMEOUT_S) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit within {timeout} s; its log:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(EXIT_TIMEOUT_S)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics, keyed by (name, sorted labels without model_name)."""
        return parse_metrics(httpx.get(f"{self.base_url}/metrics", timeout=HTTP_TIMEOUT_S).text)

    def metric(self, name: str, **labels: str) -> float:
        return sum_samples(self.metrics(), name, **labels)


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels)] = sample.value
    return samples


def sum_samples(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(value for (sample_name, sample_labels), value in samples.items()
               if sample_name == name and wanted <= set(sample_labels))


def start_server(model_dir: Path | None, workdir: Path, *args: str, env: dict[str, str] | None = None,
                 subcommand: str = "serve", port: int | None = None) -> ServerProcess:
    """`kvpilot serve [model_dir] *args` (or another subcommand that serves HTTP, such as `router`) on
    `port` (default: a free one), once its /health answers 200."""
    port = port or _free_port()
    log_path = workdir / f"{subcommand}-{port}.log"
    command = [sys.executable, "-m", "kvpilot.runtime.cli", subcommand,
               *([] if model_dir is None else [str(model_dir)]), "--host", "127.0.0.1", "--port", str(port), *args]
    env = {**os.environ, **(env or {})}
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode} during startup:\n{server.log()[-4000:]}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    pytest.fail(f"the server did not become healthy within {STARTUP_TIMEOUT_S} s:\n{server.log()[-4000:]}")


def wait_until(condition, timeout: float = 60.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None,
                        param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


def sse_events(lines) -> list:
    """The JSON payloads of a server-sent-event stream, with the final "[DONE]" as a string."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


class RawRequest:
    """A POST over a plain socket, so that a test can hold it half-sent, or drop it mid-flight.

    The server starts serving a request (and counts it in flight) once its headers arrive; the
    handler then waits for the rest of the body, which the test sends when it chooses.
    """

    def __init__(self, base_url: str, path: str, body: dict, headers: dict[str, str] | None = None) -> None:
        url = httpx.URL(base_url)
        self.payload = json.dumps(body).encode()
        self.sent = 0
        self.sock = socket.create_connection((url.host, url.port), timeout=HTTP_TIMEOUT_S)
        lines = [f"POST {path} HTTP/1.1", f"Host: {url.host}", "Content-Type: application/json",
                 f"Content-Length: {len(self.payload)}", "Connection: close"]
        lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())

    def send_body(self, upto: int | None = None) -> None:
        end = len(self.payload) if upto is None else upto
        self.sock.sendall(self.payload[self.sent:end])
        self.sent = end

    def response(self) -> tuple[int, dict]:
        """Sends what is left of the body, then reads the whole answer (the server closes after it)."""
        self.send_body()
        return parse_http_response(self.read_to_end())

    def read_to_end(self) -> bytes:
        """Everything the server sends until it closes the connection (a reset counts as a close)."""
        data = b""
        try:
            while chunk := self.sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
        self.close()
        return data

    def close(self) -> None:
        self.sock.close()


def send_whole_body_over_the_limit(base_url: str, headers: bytes = b"", body_bytes: int = 20 * 1024 * 1024) -> bytes:
    """POST a body the server refuses on its declared length, sending all of it anyway as common
    clients do, then read the answer up to the server's FIN. Without a lingering close the server
    resets the connection under the writes (BrokenPipeError or ConnectionResetError here)."""
    url = httpx.URL(base_url)
    with socket.create_connection((url.host, url.port), timeout=HTTP_TIMEOUT_S) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + headers + b"Content-Length: %d\r\n\r\n" % body_bytes)
        piece = b"x" * 65536
        for _ in range(body_bytes // len(piece)):
            sock.sendall(piece)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while data := sock.recv(65536):
            answer += data
    return answer


def parse_http_response(data: bytes) -> tuple[int, dict]:
    """(status, JSON body) of a whole HTTP/1.1 response with a Content-Length."""
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended while we looked
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def engine_core_pid(server_pid: int) -> int:
    """The EngineCore process: the server's multiprocessing child (not the resource tracker)."""
    engines = [child for child in child_pids(server_pid)
               if b"--multiprocessing-fork" in Path(f"/proc/{child}/cmdline").read_bytes()]
    assert len(engines) == 1, f"expected one engine process among the children of {server_pid}: {engines}"
    return engines[0]
