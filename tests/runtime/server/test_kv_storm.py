"""A KV-cache storm: far more concurrent work than the pool holds. Preemption (by recompute) must
lose nothing: every request ends with the greedy text it gets when it runs alone."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from server_harness import HTTP_TIMEOUT_S, start_server

# 8 usable blocks of 16 tokens: about two of these requests at their full length.
BLOCKS = 9
PROMPTS = [f"Request number {i} asks the engine about {topic}" for i, topic in
           enumerate(["rivers", "stars", "glass", "salt", "wind", "paper", "iron", "moss"])]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def small_pool_server(tiny_llama_dir, tmp_path_factory):
    process = start_server(tiny_llama_dir, tmp_path_factory.mktemp("kv-storm"), "--served-model-name", "tiny",
                           "--num-gpu-blocks-override", str(BLOCKS), "--block-size", "16",
                           "--no-enable-prefix-caching")
    yield process
    process.stop()


def _body(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def test_every_request_survives_preemption_with_its_greedy_text(small_pool_server):
    url = small_pool_server.base_url
    with httpx.Client(base_url=url, timeout=HTTP_TIMEOUT_S) as http:
        alone = [http.post("/v1/completions", json=_body(p)).json()["choices"][0]["text"] for p in PROMPTS]
    before = small_pool_server.metric("vllm:num_preemptions_total")

    async def storm() -> list[dict]:
        async with httpx.AsyncClient(base_url=url, timeout=HTTP_TIMEOUT_S) as client:
            responses = await asyncio.gather(*(client.post("/v1/completions", json=_body(p)) for p in PROMPTS))
        return [r.json() for r in responses]

    together = asyncio.run(storm())
    assert [body["choices"][0]["text"] for body in together] == alone
    assert all(body["usage"]["completion_tokens"] == MAX_TOKENS for body in together)
    assert small_pool_server.metric("vllm:num_preemptions_total") > before
    assert small_pool_server.metric("vllm:num_requests_running") == 0
    assert small_pool_server.metric("vllm:kv_cache_usage_perc") == 0
