"""Keys, tenants, priorities, limits, cache isolation, hot reload and the admin switch, end to end.

The tenant server runs one sequence at a time: a long "blocker" stream holds the only slot while
the test queues requests, so the order in which the queued ones then run is observable.
"""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest

from server_harness import (
    ADMIN_TOKEN,
    HTTP_TIMEOUT_S,
    SERVER_API_KEY,
    TENANT_KEYS,
    assert_openai_error,
    parse_metrics,
    sse_events,
    sum_samples,
    wait_until,
)

WAIT_S = 60.0


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _tenant(name: str) -> dict[str, str]:
    return _auth(TENANT_KEYS[name])


ADMIN = _auth(ADMIN_TOKEN)
SMALL = {"prompt": "A cache keeps", "max_tokens": 2, "ignore_eos": True}
# Long enough that one answer reaches the client well before the next, which starts only when it
# ends, can: two answers a step apart arrive in either order on a busy machine.
QUEUED = {**SMALL, "max_tokens": 16}


@pytest.fixture(scope="module")
def http(tenant_server):
    with httpx.Client(base_url=tenant_server.base_url, timeout=HTTP_TIMEOUT_S) as client:
        yield client


@pytest.fixture
def policy(http):
    """Sets the scheduling policy for one test, and puts fcfs back after it."""
    def set_policy(name: str) -> None:
        assert http.post("/admin/scheduling", json={"policy": name}, headers=ADMIN).status_code == 200
    yield set_policy
    set_policy("fcfs")


def test_v1_routes_need_a_valid_key(http):
    assert_openai_error(http.post("/v1/completions", json=SMALL), 401, code="invalid_api_key")
    assert_openai_error(http.post("/v1/completions", json=SMALL, headers=_auth("wrong")), 401, code="invalid_api_key")
    assert_openai_error(http.get("/v1/models", headers={"Authorization": "Basic Z29sZA=="}), 401)
    assert_openai_error(http.get("/v1/no-such-route"), 401)
    for key in [SERVER_API_KEY, *TENANT_KEYS.values()]:
        assert http.post("/v1/completions", json=SMALL, headers=_auth(key)).status_code == 200, key
    # Only probes and scrapes need no key; tokenization costs work, so it does.
    for path in ["/health", "/metrics", "/version"]:
        assert http.get(path).status_code == 200
    for path, body in [("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})]:
        assert_openai_error(http.post(path, json=body), 401, code="invalid_api_key")
        assert http.post(path, json=body, headers=_tenant("gold")).status_code == 200
    assert_openai_error(http.get("/openapi.json"), 401)
    assert_openai_error(http.get("/no-such-route"), 401)


def test_a_trusted_header_names_the_tenant_but_the_server_key_is_still_required(tenant_server, http):
    def bronze_requests() -> float:
        return tenant_server.metric("kvpilot:tenant_requests_total", tenant="bronze")

    before = bronze_requests()
    headers = {**_auth(SERVER_API_KEY), "X-Kvpilot-Tenant": "bronze"}
    assert http.post("/v1/completions", json=SMALL, headers=headers).status_code == 200
    assert bronze_requests() == before + 1
    assert_openai_error(http.post("/v1/completions", json=SMALL, headers={"X-Kvpilot-Tenant": "bronze"}), 401)
    assert_openai_error(http.post("/v1/completions", json=SMALL,
                                  headers={**_auth(SERVER_API_KEY), "X-Kvpilot-Tenant": "nobody"}),
                        401, code="invalid_tenant")


def test_tenant_requests_are_counted_per_tenant(tenant_server, http):
    before = tenant_server.metrics()
    http.post("/v1/completions", json=SMALL, headers=_tenant("gold"))
    http.post("/v1/completions", json={**SMALL, "n": 2}, headers=_tenant("flex"))
    after = tenant_server.metrics()
    for tenant, count in [("gold", 1), ("flex", 2), ("bronze", 0)]:
        labels = {"tenant": tenant, "finished_reason": "length"}
        assert sum_samples(after, "kvpilot:tenant_requests_total", **labels) - \
            sum_samples(before, "kvpilot:tenant_requests_total", **labels) == count


def test_same_prompt_never_hits_another_tenants_prefix_cache(tenant_server, http):
    prompt = "Isolation check: " + " ".join(f"item{i}" for i in range(40))

    def hits_after(tenant: str) -> float:
        before = tenant_server.metric("vllm:prefix_cache_hits_total")
        response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}, headers=_tenant(tenant))
        assert response.status_code == 200
        return tenant_server.metric("vllm:prefix_cache_hits_total") - before

    assert hits_after("gold") == 0
    assert hits_after("bronze") == 0
    # The same request salt does not make two tenants share either.
    assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "cache_salt": "shared"},
                     headers=_tenant("flex")).status_code == 200
    before = tenant_server.metric("vllm:prefix_cache_hits_total")
    http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "cache_salt": "shared"},
              headers=_tenant("gold"))
    assert tenant_server.metric("vllm:prefix_cache_hits_total") == before
    assert hits_after("gold") > 0
    assert hits_after("bronze") > 0


# -- queue order ------------------------------------------------------------------------------------


async def _start_order(base_url: str, queued: list[tuple[dict, dict]], before_release=None) -> list[int]:
    """Queues `queued` (headers, extra body) behind a blocker, one at a time, and returns their
    indices in the order they ran (with one slot, the order they finish)."""
    finished: list[int] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=HTTP_TIMEOUT_S) as client:

        async def waiting() -> float:
            return sum_samples(parse_metrics((await client.get("/metrics")).text), "vllm:num_requests_waiting")

        async def until_waiting(count: int) -> None:
            for _ in range(int(WAIT_S / 0.05)):
                if await waiting() == count:
                    return
                await asyncio.sleep(0.05)
            pytest.fail(f"never saw {count} request(s) waiting")

        async def run(index: int, headers: dict, extra: dict) -> None:
            response = await client.post("/v1/completions", json={**QUEUED, **extra}, headers=headers)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == QUEUED["max_tokens"]
            finished.append(index)

        blocker = {"prompt": "blocker", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=blocker, headers=_auth(SERVER_API_KEY)) as stream:
            assert stream.status_code == 200
            # Held in a variable: a line iterator dropped mid-stream would close the connection.
            lines = stream.aiter_lines()
            while not (await anext(lines)).startswith("data: "):
                pass  # until the blocker runs
            tasks = []
            for index, (headers, extra) in enumerate(queued):
                tasks.append(asyncio.create_task(run(index, headers, extra)))
                await until_waiting(index + 1)
            if before_release is not None:
                await before_release(client)
        # Leaving the stream closes it: the blocker is aborted and the queue starts moving.
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
    return finished


def test_tenant_priority_decides_who_runs_first(tenant_server, policy):
    policy("priority")
    queued = [
        (_tenant("bronze"), {}),                  # tenant priority 10
        (_tenant("gold"), {"priority": 100}),     # 0: gold may not set its own priority
        (_tenant("flex"), {"priority": 20}),      # 20: flex may run later than its own 5
        (_tenant("flex"), {}),                    # 5: flex's own default
        (_tenant("flex"), {"priority": -2**63}),  # 5: but never sooner
    ]
    assert asyncio.run(_start_order(tenant_server.base_url, queued)) == [1, 3, 4, 0, 2]


def test_policy_switch_under_load_reorders_the_queue_and_loses_nothing(tenant_server, http, policy):
    queued = [(_tenant("bronze"), {}), (_tenant("flex"), {}), (_tenant("gold"), {})]
    assert asyncio.run(_start_order(tenant_server.base_url, queued)) == [0, 1, 2]

    async def switch(client: httpx.AsyncClient) -> None:
        response = await client.post("/admin/scheduling", json={"policy": "priority"}, headers=ADMIN)
        assert response.json() == {"scheduling_policy": "priority"}

    assert asyncio.run(_start_order(tenant_server.base_url, queued, before_release=switch)) == [2, 1, 0]
    assert http.get("/health").json() == {"status": "ok", "scheduling_policy": "priority"}
    samples = tenant_server.metrics()
    assert sum_samples(samples, "kvpilot:scheduling_policy_info", policy="priority") == 1
    assert sum_samples(samples, "kvpilot:scheduling_policy_info", policy="fcfs") == 0


def test_admin_endpoint_needs_its_token_and_a_known_policy(http):
    assert_openai_error(http.post("/admin/scheduling", json={"policy": "priority"}), 401)
    assert_openai_error(http.post("/admin/scheduling", json={"policy": "priority"}, headers=_auth(SERVER_API_KEY)),
                        401)
    assert_openai_error(http.post("/admin/scheduling", json={"policy": "random"}, headers=ADMIN), 400, param="policy")
    assert_openai_error(http.post("/admin/scheduling", content=b"{", headers=ADMIN), 400)
    assert http.get("/health").json()["scheduling_policy"] == "fcfs"


def test_a_tenant_over_its_concurrency_limit_gets_429(tenant_server, http):
    before = tenant_server.metrics()
    body = {"prompt": "held", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body, headers=_tenant("limited")) as held:
        assert held.status_code == 200
        error = assert_openai_error(http.post("/v1/completions", json=SMALL, headers=_tenant("limited")), 429,
                                    code="rate_limit_exceeded")
        assert "limited" in error["message"]
        # Other tenants are not limited by it.
        assert http.post("/v1/completions", json=SMALL, headers=_tenant("gold")).status_code == 200
    wait_until(lambda: tenant_server.metric("vllm:num_requests_running") == 0, what="the held request to end")
    assert http.post("/v1/completions", json=SMALL, headers=_tenant("limited")).status_code == 200
    assert_openai_error(http.post("/v1/completions", json=SMALL, headers={"Authorization": "Bearer nobody"}), 401)
    # Every answer is counted by tenant and status; a refused key names no tenant.
    after = tenant_server.metrics()
    counted = {(tenant, code): sum_samples(after, "kvpilot:http_responses_total", tenant=tenant, code=code)
               - sum_samples(before, "kvpilot:http_responses_total", tenant=tenant, code=code)
               for tenant, code in (("limited", "200"), ("limited", "429"), ("gold", "200"), ("", "401"))}
    assert counted == {("limited", "200"): 2, ("limited", "429"): 1, ("gold", "200"): 1, ("", "401"): 1}


def test_a_batch_of_prompts_counts_one_sequence_per_choice(http):
    # Two prompts are two sequences: over the limited tenant's one, however small each is.
    error = assert_openai_error(
        http.post("/v1/completions", json={**SMALL, "prompt": ["a", "b"]}, headers=_tenant("limited")), 400, param="n")
    assert "2 sequences" in error["message"]
    assert http.post("/v1/completions", json={**SMALL, "prompt": ["a"]}, headers=_tenant("limited")).status_code == 200
    body = http.post("/v1/completions", json={**SMALL, "prompt": ["a", "b"], "n": 2}, headers=_tenant("gold")).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]


def _write_atomically(path, text: str) -> None:
    # As Kubernetes does: the new content appears in one step, under a new inode.
    scratch = path.with_suffix(".new")
    scratch.write_text(text)
    os.replace(scratch, path)


def test_tenants_file_is_reloaded_without_dropping_requests(tenant_server, http, tenants_dir):
    tenants_file = tenants_dir / "tenants.json"
    original = tenants_file.read_text()
    newcomer = _auth("newcomer-key")
    assert http.post("/v1/completions", json=SMALL, headers=newcomer).status_code == 401

    body = {"prompt": "in flight", "max_tokens": 40, "ignore_eos": True, "stream": True}
    try:
        with http.stream("POST", "/v1/completions", json=body, headers=_tenant("gold")) as in_flight:
            tenants = json.loads(original) + [{"name": "newcomer", "apiKeys": ["newcomer-key"]}]
            _write_atomically(tenants_file, json.dumps(tenants))
            wait_until(lambda: http.post("/v1/completions", json=SMALL, headers=newcomer).status_code == 200,
                       timeout=WAIT_S, interval=0.2, what="the new tenant's key to work")
            events = sse_events(in_flight.iter_lines())
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"

        # A broken file keeps the tenants as they were.
        _write_atomically(tenants_file, "[{")
        wait_until(lambda: "tenants file not reloaded" in tenant_server.log(), timeout=WAIT_S, interval=0.2,
                   what="the broken file to be noticed")
        assert http.post("/v1/completions", json=SMALL, headers=newcomer).status_code == 200
    finally:
        _write_atomically(tenants_file, original)
    wait_until(lambda: http.post("/v1/completions", json=SMALL, headers=newcomer).status_code == 401,
               timeout=WAIT_S, interval=0.2, what="the newcomer's key to be revoked")
    assert http.post("/v1/completions", json=SMALL, headers=_tenant("gold")).status_code == 200
