"""A tenant's maxConcurrentRequests holds across the fleet: two routers share it out, with no
store between them, over two replicas that would each admit the whole limit on their own."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from server_harness import HTTP_TIMEOUT_S, TENANT_KEYS, _free_port, start_server, wait_until

pytestmark = pytest.mark.timeout(300)

LIMIT = 4


def test_a_tenant_limited_to_4_runs_at_most_4_across_two_routers(tiny_llama_dir, tmp_path):
    tenants = [{"name": "limited", "priority": 0, "apiKeys": [TENANT_KEYS["limited"]], "maxConcurrentRequests": LIMIT},
               {"name": "gold", "priority": 0, "apiKeys": [TENANT_KEYS["gold"]]}]
    (tmp_path / "tenants.json").write_text(json.dumps(tenants))
    shared = ("--tenants-file", str(tmp_path / "tenants.json"))
    replicas = [start_server(tiny_llama_dir, tmp_path, "--served-model-name", "tiny", *shared) for _ in range(2)]
    ports = [_free_port(), _free_port()]
    (tmp_path / "routers").write_text("".join(f"http://127.0.0.1:{port}\n" for port in ports))
    backends = [arg for replica in replicas for arg in ("--backend", replica.base_url)]
    routers = [start_server(tiny_llama_dir, tmp_path, *backends, *shared, "--peers-file", str(tmp_path / "routers"),
                            "--advertise-url", f"http://127.0.0.1:{port}", "--routing-strategy", "round-robin",
                            subcommand="router", port=port) for port in ports]
    running_peak = 0
    done = threading.Event()

    def watch_the_engines() -> None:
        nonlocal running_peak
        # Paced: polling flat out took the cores from the engines it watches (72 s a run on 2 cores).
        while not done.wait(0.02):
            running_peak = max(running_peak, sum(r.metric("vllm:num_requests_running") for r in replicas))

    statuses: list[int] = []

    def ask(router, key: str) -> None:
        response = httpx.post(f"{router.base_url}/v1/completions", timeout=HTTP_TIMEOUT_S,
                              headers={"Authorization": f"Bearer {TENANT_KEYS[key]}"},
                              json={"model": "tiny", "prompt": "go on", "max_tokens": 600, "ignore_eos": True})
        statuses.append(response.status_code)
        if response.status_code == 429:
            assert response.headers["retry-after"].isdigit()

    try:
        watcher = threading.Thread(target=watch_the_engines)
        watcher.start()
        burst = [threading.Thread(target=ask, args=(routers[i % 2], "limited")) for i in range(16)]
        for thread in burst:
            thread.start()
        # While the tenant is at its limit, another tenant is not affected.
        wait_until(lambda: sum(r.metric("vllm:num_requests_running") for r in replicas) > 0, timeout=30,
                   what="the burst to run")
        other = httpx.post(f"{routers[0].base_url}/v1/completions", timeout=HTTP_TIMEOUT_S,
                           headers={"Authorization": f"Bearer {TENANT_KEYS['gold']}"},
                           json={"model": "tiny", "prompt": "hello", "max_tokens": 4})
        assert other.status_code == 200, other.text
        for thread in burst:
            thread.join(HTTP_TIMEOUT_S)
        done.set()
        watcher.join(HTTP_TIMEOUT_S)
        assert statuses.count(200) == LIMIT, statuses
        assert statuses.count(429) == 16 - LIMIT, statuses
        # The routers count what they refused, by tenant.
        assert sum(r.metric("kvpilot:http_responses_total", tenant="limited", code="429") for r in routers) == 16 - LIMIT
        # The gold request ran beside the limited ones, at most LIMIT of which ever ran at once.
        assert running_peak <= LIMIT + 1, running_peak
    finally:
        done.set()
        for process in [*routers, *replicas]:
            process.stop()
