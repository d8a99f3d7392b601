"""What a hostile client can do to a real server: each test is one attack, and what must hold.

One server for the module, with keys everywhere (a server key, tenant keys, an admin token) and
tight limits, so that each limit is reached with small requests. Its log is grepped for every
secret at the end.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from kvpilot.runtime.server.connections import OBSERVATION_RESERVE, guarded_protocol
from kvpilot.runtime.server.launcher import bound_socket
from kvpilot.runtime.server.limits import ServerLimits

from server_harness import (
    HTTP_TIMEOUT_S,
    RawRequest,
    assert_openai_error,
    parse_http_response,
    send_whole_body_over_the_limit,
    start_server,
    wait_until,
)

SERVER_KEY = "sk-server-0c5e"
KEYS = {"alpha": "sk-alpha-77d1", "beta": "sk-beta-9a02"}
ADMIN_TOKEN = "admin-token-4f3b"
# Written inline into a tenants file that breaks during the tests: YAML errors quote their line.
INLINE_KEY = "sk-inline-b81c"
SECRETS = [SERVER_KEY, *KEYS.values(), ADMIN_TOKEN, INLINE_KEY]
STALL_TIMEOUT_S = 2
HEADER_TIMEOUT_S = 2
BODY_TIMEOUT_S = 5
MAX_CONNECTIONS = 24
SMALL = {"prompt": "A cache keeps", "max_tokens": 2, "ignore_eos": True}
# Every wait on the server is bounded by this: under load, not a measure of speed.
WAIT_S = 60.0


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


ALPHA = _auth(KEYS["alpha"])


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hardening-tenants")
    (folder / "admin-token").write_text(ADMIN_TOKEN)
    path = folder / "tenants.json"
    path.write_text(json.dumps([
        {"name": "alpha", "apiKeys": [KEYS["alpha"]], "maxConcurrentRequests": 2},
        {"name": "beta", "apiKeys": [KEYS["beta"]]},
    ]))
    return path


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tenants_file, tmp_path_factory):
    process = start_server(
        tiny_llama_dir, tmp_path_factory.mktemp("hardening-server"),
        "--served-model-name", "tiny", "--api-key", SERVER_KEY, "--tenants-file", str(tenants_file),
        "--admin-token-file", str(tenants_file.parent / "admin-token"),
        "--max-n", "4", "--max-stop-strings", "4", "--max-stop-string-length", "16", "--max-stop-token-ids", "8",
        "--stream-stall-timeout", str(STALL_TIMEOUT_S), "--max-buffered-outputs", "64",
        "--socket-send-buffer-bytes", "8192",
        "--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S), "--timeout-keep-alive", "2",
        "--max-connections", str(MAX_CONNECTIONS),
    )
    yield process
    process.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S, headers=ALPHA) as client:
        yield client


def _connect(server, rcvbuf: int | None = None) -> socket.socket:
    url = httpx.URL(server.base_url)
    sock = socket.socket()
    if rcvbuf is not None:
        # Set before connecting, so the window the server sees is small from the start.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(HTTP_TIMEOUT_S)
    sock.connect((url.host, url.port))
    return sock


def _closed_by_server(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except (TimeoutError, socket.timeout):
        return False
    except ConnectionResetError:
        pass
    return True


# Linux's tcp_info starts with the connection's state; TCP_CLOSE is what a reset leaves.
TCP_CLOSE = 7


def _tcp_state(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]


def test_every_route_but_the_probes_needs_a_key(server):
    with httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S) as anonymous:
        for method, path, body in [("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [1]}),
                                   ("GET", "/v1/models", None), ("GET", "/openapi.json", None),
                                   ("GET", "/nowhere", None)]:
            assert_openai_error(anonymous.request(method, path, json=body), 401, code="invalid_api_key")
        for path in ["/health", "/version", "/metrics"]:
            assert anonymous.get(path).status_code == 200


def test_a_body_over_the_limit_is_413_before_it_is_sent(server):
    refused_before = server.metric("kvpilot:http_responses_total", tenant="", code="413")
    # A declared length over the limit: answered at once, without a byte of the body.
    sock = _connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + KEYS["alpha"].encode() + b"\r\n"
                 b"Content-Length: 20000000\r\n\r\n")
    head = sock.recv(65536).split(b"\r\n\r\n", 1)[0]
    sock.close()
    assert head.startswith(b"HTTP/1.1 413"), head
    # Counted with the answers, before the key was read (so under no tenant).
    assert server.metric("kvpilot:http_responses_total", tenant="", code="413") == refused_before + 1


def test_a_refused_body_is_read_to_its_end_then_the_connection_closes_cleanly(server):
    # Without a lingering close, clients on other kernels, or behind a lossy link, lose the 413
    # that was on its way when the server's close resets the connection.
    answer = send_whole_body_over_the_limit(server.base_url, b"Authorization: Bearer " + KEYS["alpha"].encode() + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 413"), answer[:100]
    assert b"--max-request-body-bytes" in answer


@pytest.mark.parametrize("client", ["httpx", "openai"])
def test_a_refused_body_still_gets_its_413_and_health_answers_meanwhile(server, client):
    # The client sends all 20 MB before it reads: the server reads and drops the rest after its
    # answer (a lingering close), or the client would see its connection reset instead of the 413.
    prompt = "x" * (20 * 1024 * 1024)
    outcome = {}

    def send():
        if client == "httpx":
            with httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S, headers=ALPHA) as http:
                outcome["status"] = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt}).status_code
        else:
            import openai

            sdk = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEYS["alpha"], max_retries=0,
                                timeout=HTTP_TIMEOUT_S)
            try:
                sdk.completions.create(model="tiny", prompt=prompt, max_tokens=1)
            except openai.APIStatusError as err:
                outcome["status"] = err.status_code

    sender = threading.Thread(target=send)
    sender.start()
    with httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S) as probe:
        while sender.is_alive():
            assert probe.get("/health").status_code == 200
            time.sleep(0.05)
    sender.join()
    assert outcome.get("status") == 413


def test_a_chunked_body_over_the_limit_is_413(http):
    chunk = b"x" * 65536

    def body():
        for _ in range(65):  # one chunk over the 4 MiB default
            yield chunk

    response = http.post("/tokenize", content=body(), headers={"Content-Type": "application/json"})
    error = assert_openai_error(response, 413, code=None)
    assert "--max-request-body-bytes" in error["message"]


def test_a_prompt_too_long_by_its_size_is_refused_before_tokenizing(http):
    max_model_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    # Far more bytes than max_model_len tokens can cover.
    error = assert_openai_error(http.post("/v1/completions", json={"prompt": "ab " * 200_000}), 400, param="prompt")
    assert "at least" in error["message"] and str(max_model_len) in error["message"]
    messages = [{"role": "user", "content": "ab " * 200_000}]
    error = assert_openai_error(http.post("/v1/chat/completions", json={"messages": messages}), 400, param="messages")
    assert "at least" in error["message"]


def test_health_answers_while_the_heaviest_request_is_tokenized(server, http):
    """A body just under the limit, all of it text to tokenize: /health keeps answering meanwhile.

    The measure is relative: no /health may take more than a fraction of the heavy request's
    own time, which on the event loop it would (the loop being blocked for the tokenization).
    """
    text = "the quick brown fox jumps over the lazy dog " * 95_000  # ~4.1 MB
    heavy: dict = {}

    def tokenize() -> None:
        started = time.monotonic()
        response = http.post("/tokenize", json={"prompt": text})
        heavy.update(status=response.status_code, seconds=time.monotonic() - started,
                     count=response.json().get("count"))

    worker = threading.Thread(target=tokenize)
    worker.start()
    latencies = []
    with httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S) as probe:
        while worker.is_alive():
            started = time.monotonic()
            assert probe.get("/health").status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.05)
    worker.join()
    assert heavy["status"] == 200 and heavy["count"] > 100_000
    assert len(latencies) >= 3, (heavy, latencies)
    assert max(latencies) < heavy["seconds"] / 3, (heavy, latencies)


def test_stop_strings_and_stop_token_ids_are_bounded(http):
    for field, value, param in [("stop", ["a", "b", "c", "d", "e"], "stop"), ("stop", ["x" * 17], "stop"),
                                ("stop_token_ids", list(range(9)), "stop_token_ids")]:
        error = assert_openai_error(http.post("/v1/completions", json={**SMALL, field: value}), 400, param=param)
        assert "--max-stop" in error["message"]
    # Within the limits they work.
    assert http.post("/v1/completions", json={**SMALL, "stop": ["x" * 16] * 4,
                                              "stop_token_ids": list(range(8))}).status_code == 200


def test_n_is_bounded_and_counted_as_sequences_against_the_tenant(server, http):
    assert "--max-n" in assert_openai_error(http.post("/v1/completions", json={**SMALL, "n": 5}), 400,
                                            param="n")["message"]
    # alpha may run 2 sequences: n=3 can never fit, so it is a 400, not a 429.
    error = assert_openai_error(http.post("/v1/completions", json={**SMALL, "n": 3}), 400, param="n")
    assert "alpha" in error["message"]
    held = {"prompt": "held", "max_tokens": 1500, "ignore_eos": True, "stream": True, "n": 2}
    with http.stream("POST", "/v1/completions", json=held) as stream:
        assert stream.status_code == 200
        # One request holding two sequences fills alpha's limit.
        refused = http.post("/v1/completions", json=SMALL)
        assert_openai_error(refused, 429, code="rate_limit_exceeded")
        assert refused.headers["Retry-After"].isdigit()
        assert http.post("/v1/completions", json=SMALL, headers=_auth(KEYS["beta"])).status_code == 200
    wait_until(lambda: server.metric("vllm:num_requests_running") == 0, timeout=WAIT_S,
               what="the held sequences to end")
    assert http.post("/v1/completions", json={**SMALL, "n": 2}).status_code == 200


def test_a_client_that_stops_reading_is_aborted_and_frees_its_sequences(server, http):
    before = server.metric("kvpilot:slow_client_aborts_total")
    # Logprobs make each event large, so that few tokens fill the (small) socket buffers.
    body = json.dumps({"prompt": "never read", "max_tokens": 1500, "ignore_eos": True, "stream": True, "n": 2,
                       "logprobs": 20})
    sock = _connect(server, rcvbuf=4096)
    sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Authorization: Bearer {KEYS['alpha']}\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
    try:
        wait_until(lambda: server.metric("kvpilot:slow_client_aborts_total") == before + 1, timeout=2 * WAIT_S,
                   interval=0.2, what="the stalled stream to be aborted")
        # The server hung up on it, instead of waiting forever for its buffer to drain.
        assert _closed_by_server(sock, WAIT_S)
        # The engine stopped working for it, and alpha's two sequences are free again.
        wait_until(lambda: server.metric("vllm:num_requests_running") == 0, timeout=WAIT_S,
                   what="the engine to drop the aborted sequences")
        assert server.metric("vllm:kv_cache_usage_perc") == 0
        assert http.post("/v1/completions", json={**SMALL, "n": 2}).status_code == 200
    finally:
        sock.close()


@pytest.mark.parametrize("connection", ["keep-alive", "close"])
def test_a_client_that_never_reads_a_whole_response_is_dropped(server, connection):
    # A response far larger than the socket buffers, complete on the server's side: neither
    # uvicorn's keep-alive close nor its close after `Connection: close` ever finishes (both wait
    # for the client to take the rest first), so the connection stayed open for good.
    body = json.dumps({"prompt": "word " * 50_000}).encode()
    sock = _connect(server, rcvbuf=4096)
    sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + KEYS["alpha"].encode() + b"\r\n"
                 b"Connection: " + connection.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    try:
        # Watched without reading, which would drain the buffers: the server's reset closes the socket.
        wait_until(lambda: _tcp_state(sock) == TCP_CLOSE, timeout=WAIT_S, interval=0.2,
                   what="the server to drop the connection")
    finally:
        sock.close()


def test_half_open_and_idle_connections_are_closed_and_capped(server):
    # Slowloris: half of them send part of a request head, the other half nothing at all; more
    # than the cap in all, so the last ones are closed at once.
    sockets = [_connect(server) for _ in range(MAX_CONNECTIONS + OBSERVATION_RESERVE + 6)]
    for sock in sockets[::2]:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    deadline = time.monotonic() + WAIT_S
    try:
        for sock in sockets:
            assert _closed_by_server(sock, max(0.1, deadline - time.monotonic())), "a connection stayed open"
    finally:
        for sock in sockets:
            sock.close()
    with httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S) as fresh:
        assert fresh.get("/health").status_code == 200
    assert "--max-connections" in server.log()  # the ones over the cap were refused on arrival


def test_bodies_that_stop_arriving_are_answered_408_and_their_connections_freed(server):
    # A slow POST: as many connections as the server allows send their head and the start of
    # their body, then nothing; without a deadline they would hold the server (/health too) forever.
    stuck = [RawRequest(server.base_url, "/v1/completions", SMALL, headers=ALPHA) for _ in range(MAX_CONNECTIONS)]
    try:
        for request in stuck:
            request.send_body(upto=5)
        for request in stuck:
            status, body = parse_http_response(request.read_to_end())
            assert status == 408 and set(body) == {"error"}, body
            assert "--body-timeout" in body["error"]["message"]
    finally:
        for request in stuck:
            request.close()
    with httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S) as fresh:
        assert fresh.get("/health").status_code == 200


def test_with_every_connection_taken_the_probes_still_answer_and_requests_get_503(server):
    # What a saturated server looks like from outside (here: uploads in progress): the kubelet's
    # probes and the operator's scrapes must still get through, or the pod is restarted, and its
    # work lost, exactly when it is busiest; other requests are told to come back.
    held = [RawRequest(server.base_url, "/v1/completions", SMALL, headers=ALPHA) for _ in range(MAX_CONNECTIONS)]
    try:
        for request in held:
            request.send_body(upto=5)
        with httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S, headers=ALPHA) as over:
            assert over.get("/health").status_code == 200
            assert "vllm:num_requests_running" in over.get("/metrics").text
            refused = over.post("/v1/completions", json=SMALL)
            assert_openai_error(refused, 503, code="too_many_connections")
            assert refused.headers["Retry-After"].isdigit()
    finally:
        for request in held:
            request.close()


def test_an_idle_keep_alive_connection_is_closed(server):
    sock = _connect(server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    assert _closed_by_server(sock, WAIT_S)
    sock.close()


def test_the_smaller_holes(server, http):
    # 405 names what is allowed.
    response = http.get("/v1/completions")
    assert_openai_error(response, 405)
    assert "POST" in response.headers["Allow"]
    # What vLLM shows for the model, and not where it lies on disk.
    model = http.get("/v1/models").json()["data"][0]
    assert model["root"] == "tiny" and "/" not in json.dumps(model)
    # The schema documents the 400 this server answers, not FastAPI's 422.
    schema = http.get("/openapi.json").json()
    responses = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert "422" not in responses and "400" in responses
    # An unknown chat role is refused.
    assert_openai_error(http.post("/v1/chat/completions", json={
        "messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 1}), 400)
    # Strict types over the wire.
    for field, value in [("max_tokens", "5"), ("max_tokens", True), ("temperature", "Infinity")]:
        content = json.dumps({**SMALL, field: value}).replace('"Infinity"', "Infinity")
        assert_openai_error(http.post("/v1/completions", content=content,
                                      headers={"Content-Type": "application/json"}), 400, param=field)


def test_no_secret_reaches_the_log(server, http, tenants_file):
    """Last: grep the whole log of a server that saw every key, in headers and in query strings."""
    for key in SECRETS:
        http.get(f"/health?api_key={key}")
        http.post(f"/v1/completions?api_key={key}", json=SMALL, headers=_auth(key))
    original = tenants_file.read_text()
    try:
        # A broken tenants file whose broken line holds a key.
        tenants_file.write_text(f"- name: leaky\n  apiKeys: [{INLINE_KEY}\n  priority: [")
        wait_until(lambda: "tenants file not reloaded" in server.log(), timeout=WAIT_S, interval=0.2,
                   what="the broken tenants file to be noticed")
    finally:
        tenants_file.write_text(original)
    assert http.post("/v1/completions", json=SMALL).status_code == 200
    log = server.log()
    assert "POST /v1/completions" in log  # the access log is on, so the test can fail
    leaked = [secret for secret in SECRETS if secret in log]
    assert not leaked, f"secrets in the log: {leaked}"


def test_accepted_connections_send_without_waiting_for_the_clients_ack():
    """TCP_NODELAY on every connection the launched server accepts. Without it, on a reused
    keep-alive connection, the write after a response's head waited for the client's delayed ACK
    (up to 40 ms) before the first token went out."""
    async def app(scope, receive, send):
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    async def scenario() -> list[int]:
        with bound_socket("127.0.0.1", 0) as sock:
            config = uvicorn.Config(app, http=guarded_protocol(ServerLimits()), lifespan="off", log_level="warning")
            server = uvicorn.Server(config)
            serving = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started:
                await asyncio.sleep(0.01)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}") as client:
                assert (await client.get("/")).status_code == 204
                options = [protocol.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                           for protocol in server.server_state.connections]
            server.should_exit = True
            await serving
        return options

    assert asyncio.run(scenario()) == [1]
