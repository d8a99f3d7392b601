"""/metrics against vLLM V1's own list: names, types, bucket boundaries, labels; true values after requests.

VLLM_METRICS is copied by hand from vLLM's PrometheusStatLogger (vllm/v1/metrics/loggers.py), the
metrics kvpilot implements; dashboards, inference-perf and gateways query these names.
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.runtime.server.metrics import ServerMetrics, buckets_1_2_5

from server_harness import HTTP_TIMEOUT_S, sse_events, sum_samples

TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0, 160.0, 640.0, 2560.0)
TPOT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
           960.0, 1920.0, 7680.0)
# vLLM's build_1_2_5_buckets(max_model_len): the tiny model's max_model_len is 2048.
TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)

# name (as the text format writes the family) -> (type, buckets for a histogram)
VLLM_METRICS = {
    "vllm:num_requests_running": ("gauge", None),
    "vllm:num_requests_waiting": ("gauge", None),
    "vllm:kv_cache_usage_perc": ("gauge", None),
    "vllm:cache_config_info": ("gauge", None),
    "vllm:prefix_cache_queries": ("counter", None),
    "vllm:prefix_cache_hits": ("counter", None),
    "vllm:num_preemptions": ("counter", None),
    "vllm:prompt_tokens": ("counter", None),
    "vllm:generation_tokens": ("counter", None),
    "vllm:request_success": ("counter", None),
    "vllm:time_to_first_token_seconds": ("histogram", TTFT),
    "vllm:inter_token_latency_seconds": ("histogram", TPOT),
    "vllm:request_time_per_output_token_seconds": ("histogram", TPOT),
    "vllm:e2e_request_latency_seconds": ("histogram", REQUEST),
    "vllm:request_queue_time_seconds": ("histogram", REQUEST),
    "vllm:request_inference_time_seconds": ("histogram", REQUEST),
    "vllm:request_prefill_time_seconds": ("histogram", REQUEST),
    "vllm:request_decode_time_seconds": ("histogram", REQUEST),
    "vllm:request_prompt_tokens": ("histogram", TOKENS),
    "vllm:request_generation_tokens": ("histogram", TOKENS),
    "vllm:request_params_max_tokens": ("histogram", TOKENS),
    "vllm:request_params_n": ("histogram", (1, 2, 5, 10, 20)),
    "vllm:iteration_tokens_total": ("histogram", (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)),
}
# Observed once per finished request that produced a token: their _count grows by one each.
PER_REQUEST = ["vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
               "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
               "vllm:request_decode_time_seconds", "vllm:request_time_per_output_token_seconds",
               "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_params_max_tokens"]


def _families(text: str) -> dict:
    # The parser names a counter's family without its _total; vLLM's list does the same.
    return {family.name: family for family in text_string_to_metric_families(text)}


def _check_against_vllm(families: dict) -> None:
    for name, (kind, buckets) in VLLM_METRICS.items():
        assert name in families, f"{name} is missing"
        family = families[name]
        assert family.type == kind, f"{name} is a {family.type}, vLLM's is a {kind}"
        for sample in family.samples:
            assert "model_name" in sample.labels, name
        if buckets is not None:
            bounds = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
            assert bounds == [*map(float, buckets), float("inf")], name


def test_buckets_1_2_5():
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)
    assert buckets_1_2_5(2048) == TOKENS
    assert buckets_1_2_5(1) == (1,)


def test_every_vllm_metric_exists_from_the_start_with_vllms_type_and_buckets():
    metrics = ServerMetrics("m", 16, 100, max_model_len=2048)
    _check_against_vllm(_families(metrics.render().decode()))


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S) as client:
        yield client


def test_served_metrics_match_vllm_and_count_requests(server, http):
    _check_against_vllm(_families(http.get("/metrics").text))
    before = server.metrics()
    body = {"model": "tiny", "prompt": "The quick brown fox", "temperature": 0, "ignore_eos": True}
    http.post("/v1/completions", json={**body, "max_tokens": 5}).raise_for_status()
    http.post("/v1/completions", json={**body, "max_tokens": 3, "n": 2, "seed": 1}).raise_for_status()
    after = server.metrics()

    def delta(name: str) -> float:
        return sum_samples(after, name) - sum_samples(before, name)

    for name in PER_REQUEST:
        assert delta(f"{name}_count") == 3, name  # one per choice
    # One per client request, not per choice: n=1, then n=2.
    assert delta("vllm:request_params_n_count") == 2 and delta("vllm:request_params_n_sum") == 3
    assert delta("vllm:request_params_max_tokens_sum") == 5 + 3 + 3
    assert delta("vllm:request_generation_tokens_sum") == 11
    prompt_len = len(http.post("/tokenize", json={"prompt": body["prompt"]}).json()["tokens"])
    assert delta("vllm:request_prompt_tokens_sum") == 3 * prompt_len
    # Every prompt and every generated token lands in exactly one engine step.
    assert delta("vllm:iteration_tokens_total_sum") == 3 * prompt_len + 11
    assert delta("vllm:iteration_tokens_total_count") >= 5
    for name in ["vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                 "vllm:request_inference_time_seconds", "vllm:request_time_per_output_token_seconds"]:
        assert delta(f"{name}_sum") > 0, name
    # Inference is prefill then decode.
    assert delta("vllm:request_inference_time_seconds_sum") == pytest.approx(
        delta("vllm:request_prefill_time_seconds_sum") + delta("vllm:request_decode_time_seconds_sum"))
    assert delta("vllm:request_decode_time_seconds_sum") <= delta("vllm:e2e_request_latency_seconds_sum")


@pytest.mark.parametrize("path, extra", [
    ("/v1/completions", {"prompt": "The quick brown fox"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me about trains."}]}),
])
def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(http, path, extra):
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True, "n": 2,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **extra}
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    *chunks, last = events[:-1]
    prompt_tokens = last["usage"]["prompt_tokens"]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12
    seen = {0: 0, 1: 0}
    for chunk in chunks:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]
        [choice] = chunk["choices"]
        # Per choice and cumulative, as vLLM counts it (0 on chat's opening role chunks).
        assert usage["completion_tokens"] >= seen[choice["index"]]
        seen[choice["index"]] = usage["completion_tokens"]
    assert seen == {0: 6, 1: 6}


def test_without_continuous_usage_stats_chunks_carry_no_usage(http):
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as response:
        events = sse_events(response.iter_lines())
    assert all(chunk["usage"] is None for chunk in events[:-2]) and events[-2]["usage"]["completion_tokens"] == 4
