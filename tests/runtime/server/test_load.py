"""Many concurrent streams, and clients that walk away: counts stay exact and nothing leaks."""

from __future__ import annotations

import asyncio

import httpx

from server_harness import HTTP_TIMEOUT_S, RawRequest, sse_events, sum_samples, wait_until

NUM_COMPLETE = 64
NUM_ABANDONED = 16
MAX_TOKENS = 16
# Far more than a client waits for before it walks away.
LONG_MAX_TOKENS = 1500


def _prompt(i: int) -> str:
    return f"Request number {i} asks about the old library and its shelves"


async def _run_streams(base_url: str) -> tuple[list[list], list[int]]:
    limits = httpx.Limits(max_connections=NUM_COMPLETE + NUM_ABANDONED + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=HTTP_TIMEOUT_S, limits=limits) as client:

        async def complete(i: int) -> list:
            body = {"prompt": _prompt(i), "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                return sse_events([line async for line in response.aiter_lines()])

        async def abandon(i: int) -> int:
            body = {"prompt": _prompt(1000 + i), "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True, "stream": True}
            received = 0
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        received += 1
                        if received == 2:
                            break
            # Leaving the block with the body unread closes the connection: the client is gone.
            return received

        results = await asyncio.gather(*(complete(i) for i in range(NUM_COMPLETE)),
                                       *(abandon(i) for i in range(NUM_ABANDONED)))
    return results[:NUM_COMPLETE], results[NUM_COMPLETE:]


def _idle(server) -> bool:
    samples = server.metrics()
    return sum_samples(samples, "vllm:num_requests_running") == 0 and sum_samples(samples, "vllm:num_requests_waiting") == 0


def test_concurrent_streams_count_exactly_and_abandoned_ones_free_everything(server):
    before = server.metrics()
    completed, abandoned = asyncio.run(_run_streams(server.base_url))

    prompt_counts = {i: httpx.post(f"{server.base_url}/tokenize", json={"prompt": _prompt(i)}).json()["count"]
                     for i in range(NUM_COMPLETE)}
    for i, events in enumerate(completed):
        assert events[-1] == "[DONE]"
        *chunks, usage_chunk, _ = events
        # logprobs=0 lists each sampled token once: the tokens actually streamed.
        streamed_tokens = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks)
        assert streamed_tokens == MAX_TOKENS
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert usage_chunk["usage"] == {"prompt_tokens": prompt_counts[i], "completion_tokens": MAX_TOKENS,
                                        "total_tokens": prompt_counts[i] + MAX_TOKENS}
    assert abandoned == [2] * NUM_ABANDONED

    wait_until(lambda: _idle(server), what="the engine to go idle")
    after = server.metrics()
    assert sum_samples(after, "vllm:kv_cache_usage_perc") == 0

    def delta(name: str, **labels: str) -> float:
        return sum_samples(after, name, **labels) - sum_samples(before, name, **labels)

    assert delta("vllm:request_success_total", finished_reason="length") == NUM_COMPLETE
    assert delta("vllm:request_success_total", finished_reason="abort") == NUM_ABANDONED
    assert delta("vllm:request_success_total") == NUM_COMPLETE + NUM_ABANDONED
    assert delta("vllm:prompt_tokens_total") >= sum(prompt_counts.values())


def test_a_client_leaving_a_non_streaming_request_aborts_it(server):
    aborted_before = server.metric("vllm:request_success_total", finished_reason="abort")
    request = RawRequest(server.base_url, "/v1/completions",
                         {"prompt": _prompt(-1), "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True})
    request.send_body()
    wait_until(lambda: server.metric("vllm:num_requests_running") == 1, what="the request to run")
    request.close()
    wait_until(lambda: server.metric("vllm:request_success_total", finished_reason="abort") == aborted_before + 1,
               what="the request to be aborted")
    wait_until(lambda: _idle(server), what="the engine to go idle")
    assert server.metric("vllm:kv_cache_usage_perc") == 0
