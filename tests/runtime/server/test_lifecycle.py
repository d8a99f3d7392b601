"""SIGTERM drains, and a dead EngineCore takes the server down; each test ends its own server.

A request whose body is only partly sent is in flight for as long as the test wants: that makes
"while a request is still running" a state the test controls instead of a race.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from server_harness import (
    HTTP_TIMEOUT_S,
    RawRequest,
    assert_openai_error,
    engine_core_pid,
    parse_http_response,
    sse_events,
    start_server,
    wait_until,
)

BODY = {"prompt": "The orchestra tuned their instruments", "max_tokens": 8, "ignore_eos": True}


def _socket_folders(pid: int) -> set[Path]:
    """The folders of the unix sockets process `pid` has open (its ZMQ ipc endpoints)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except FileNotFoundError:  # closed since the listing (a request's connection, say)
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    folders = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes:
            folders.add(Path(fields[7]).parent)
    return folders


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _in_flight(server) -> float:
    return server.metric("kvpilot:http_requests_in_flight")


def _hold_request(server) -> RawRequest:
    """A completion request sent up to its last byte, counted in flight by the server."""
    held = RawRequest(server.base_url, "/v1/completions", BODY)
    held.send_body(upto=len(held.payload) - 1)
    wait_until(lambda: _in_flight(server) == 1, what="the held request to be in flight")
    return held


@pytest.fixture
def own_server(tiny_llama_dir, tmp_path):
    servers = []

    def start(*args: str):
        servers.append(start_server(tiny_llama_dir, tmp_path, *args))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def test_sigterm_drains_running_requests_then_exits_0(own_server):
    server = own_server("--shutdown-timeout", "120")
    held = _hold_request(server)
    with httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S) as http:
        stream_body = {**BODY, "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", "/v1/completions", json=stream_body) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))

            server.process.send_signal(signal.SIGTERM)
            wait_until(lambda: http.get("/health").status_code == 503, what="/health to turn 503")
            assert http.get("/health").json()["status"] == "draining"
            assert_openai_error(http.post("/v1/completions", json=BODY), 503, code="shutting_down")
            assert server.process.poll() is None  # still serving what it had

            # Both requests that were in flight run to their end.
            status, body = held.response()
            assert status == 200 and body["choices"][0]["finish_reason"] == "length"
            assert body["usage"]["completion_tokens"] == BODY["max_tokens"]
            events = sse_events([first, *lines])
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 64
    assert server.wait_exit() == 0


def test_requests_still_running_at_the_shutdown_timeout_are_aborted(own_server):
    server = own_server("--shutdown-timeout", "0.5")
    held = _hold_request(server)  # its body is never finished
    with httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S) as http:
        with http.stream("POST", "/v1/completions", json={**BODY, "max_tokens": 1500, "stream": True}) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            server.process.send_signal(signal.SIGTERM)
            # A stream under way is cut short with an error event that says so, and no [DONE].
            events = sse_events([first, *lines])
    assert events[-1]["error"]["code"] == "shutting_down"
    assert "[DONE]" not in events
    # The request that had no answer yet gets a 503.
    status, body = parse_http_response(held.read_to_end())
    assert status == 503 and body["error"]["code"] == "shutting_down"
    assert server.wait_exit() == 0


def test_a_dead_engine_fails_requests_and_the_server_exits_nonzero(own_server):
    server = own_server()
    held = _hold_request(server)
    with httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S) as http:
        stream_body = {**BODY, "max_tokens": 1500, "stream": True}
        with http.stream("POST", "/v1/completions", json=stream_body) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            os.kill(engine_core_pid(server.pid), signal.SIGKILL)
            # The stream ends with an error event, and without [DONE].
            events = sse_events([first, *lines])
        assert "error" in events[-1] and events[-1]["error"]["code"] == "engine_dead"
        assert "[DONE]" not in events

        health = http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "dead"
        assert_openai_error(http.post("/v1/completions", json=BODY), 503, code="engine_dead")
    status, body = held.response()
    assert status == 503 and body["error"]["code"] == "engine_dead"
    assert server.wait_exit() != 0


def test_the_engine_exits_with_its_api_server_killed_under_load_and_leaves_no_socket_folder(own_server):
    server = own_server()
    engine = engine_core_pid(server.pid)
    ipc_dirs = _socket_folders(server.pid)
    assert ipc_dirs, "the server should have bound its sockets in a folder"
    with httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S) as http:
        with http.stream("POST", "/v1/completions", json={**BODY, "max_tokens": 1500, "stream": True}) as stream:
            next(line for line in stream.iter_lines() if line.startswith("data: "))
            # The engine is in the middle of generating: busy, not idle.
            os.kill(server.pid, signal.SIGKILL)
            server.process.wait(HTTP_TIMEOUT_S)
    wait_until(lambda: not Path(f"/proc/{engine}").exists() or _is_zombie(engine), timeout=30,
               what="the engine to exit after its API server's death")
    assert not any(folder.exists() for folder in ipc_dirs)
