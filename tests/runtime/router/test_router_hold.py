"""No replica ready: requests are held, in tenant priority order, until one is; past --hold-timeout
they get a 503 with Retry-After. Replicas come from a backends file, as in a scale from zero."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from server_harness import (HTTP_TIMEOUT_S, TENANT_KEYS, assert_openai_error, send_whole_body_over_the_limit,
                            start_server, wait_until)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("router-tenants")
    tenants = [{"name": "gold", "priority": 0, "apiKeys": [TENANT_KEYS["gold"]]},
               {"name": "bronze", "priority": 10, "apiKeys": [TENANT_KEYS["bronze"]]}]
    (folder / "tenants.json").write_text(json.dumps(tenants))
    (folder / "salt").write_text("a secret the fleet shares\n")
    return folder


def held(router) -> float:
    return router.metric("kvpilot:router_requests_held")


def test_held_until_a_replica_appears_most_urgent_tenant_first(tiny_llama_dir, tenants_file, tmp_path):
    backends = tmp_path / "backends"
    backends.write_text("# no replica yet: the fleet is at zero\n")
    shared = ("--tenants-file", str(tenants_file / "tenants.json"),
              "--cache-salt-secret-file", str(tenants_file / "salt"))
    router = start_server(tiny_llama_dir, tmp_path, "--backends-file", str(backends), "--hold-timeout", "120", "--log-level", "debug",
                          *shared, subcommand="router")
    finished: list[str] = []
    answers: dict[str, httpx.Response] = {}

    def ask(name: str, tenant: str) -> None:
        answers[name] = httpx.post(f"{router.base_url}/v1/completions", timeout=HTTP_TIMEOUT_S,
                                   headers={"Authorization": f"Bearer {TENANT_KEYS[tenant]}"},
                                   json={"model": "tiny", "prompt": f"request {name}", "max_tokens": 400,
                                         "temperature": 0, "ignore_eos": True})
        finished.append(name)

    try:
        threads = []
        for name, tenant in [("bronze-1", "bronze"), ("bronze-2", "bronze"), ("gold", "gold")]:
            threads.append(threading.Thread(target=ask, args=(name, tenant)))
            threads[-1].start()
            # Each is held before the next is sent, so arrival order is bronze, bronze, gold.
            wait_until(lambda: held(router) == len(threads), timeout=30, what=f"{name} to be held")
        # One sequence at a time: the order the replica gets them is the order they are answered in.
        replica = start_server(tiny_llama_dir, tmp_path, "--served-model-name", "tiny", "--max-num-seqs", "1",
                               *shared)
        try:
            started = time.monotonic()
            backends.write_text(replica.base_url + "\n")
            for thread in threads:
                thread.join(HTTP_TIMEOUT_S)
            waited = time.monotonic() - started
            assert all(answers[name].status_code == 200 for name in answers), {n: a.text for n, a in answers.items()}
            assert finished[0] == "gold", finished
            assert held(router) == 0
            print(f"held requests answered {waited:.2f} s after the replica was added")
        finally:
            replica.stop()
    finally:
        router.stop()


def test_past_the_hold_timeout_a_503_with_retry_after(tiny_llama_dir, tmp_path):
    router = start_server(tiny_llama_dir, tmp_path, "--backends-file", str(tmp_path / "missing"),
                          "--hold-timeout", "0.5", subcommand="router")
    try:
        for route, body in [("/v1/completions", {"model": "tiny", "prompt": "hi"}),
                            ("/v1/chat/completions", {"model": "tiny", "stream": True,
                                                      "messages": [{"role": "user", "content": "hi"}]})]:
            response = httpx.post(router.base_url + route, json=body, timeout=HTTP_TIMEOUT_S)
            assert_openai_error(response, 503, code="no_replica_ready")
            assert response.headers["retry-after"].isdigit()
        assert router.metric("kvpilot:router_hold_timeouts_total") == 2
        # Bad input is still refused at once, held or not.
        assert_openai_error(httpx.post(f"{router.base_url}/v1/completions", content=b"{not json",
                                       timeout=HTTP_TIMEOUT_S), 400)
        # A body over the limit gets its 413 through a lingering close, as from kvpilot serve.
        assert send_whole_body_over_the_limit(router.base_url).startswith(b"HTTP/1.1 413")
        assert router.metric("kvpilot:http_responses_total", tenant="", code="413") == 1
        health = httpx.get(f"{router.base_url}/health", timeout=HTTP_TIMEOUT_S)
        assert health.status_code == 200 and health.json()["replicas_ready"] == 0
    finally:
        router.stop()
