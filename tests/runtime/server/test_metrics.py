"""ServerMetrics as AsyncLLM's StatLogger: exact names, true values (no server needed)."""

from __future__ import annotations

from kvpilot.runtime.engine.output_processor import FinishedRequestStats
from kvpilot.runtime.engine.messages import EngineStats
from kvpilot.runtime.server.metrics import ServerMetrics

from server_harness import parse_metrics, sum_samples


def _stats(**fields) -> EngineStats:
    values = dict(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_preemptions=0, prefix_cache_queries=0,
                  prefix_cache_hits=0, scheduling_policy="fcfs")
    return EngineStats(**{**values, **fields})


def _finished(**fields) -> FinishedRequestStats:
    values = dict(finish_reason="length", num_prompt_tokens=7, num_generation_tokens=3, num_cached_tokens=0,
                  e2e_latency=0.5, time_to_first_token=0.1, inter_token_latencies=[0.01, 0.02], queue_time=0.05)
    return FinishedRequestStats(**{**values, **fields})


def _samples(metrics: ServerMetrics):
    return parse_metrics(metrics.render().decode())


def test_every_series_exists_from_the_start_with_the_model_name():
    metrics = ServerMetrics("m", block_size=16, num_gpu_blocks=100)
    text = metrics.render().decode()
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "kvpilot:http_requests_in_flight"]:
        assert f'{name}{{model_name="m"}} 0.0' in text, name
    for reason in ["stop", "length", "abort"]:
        assert f'vllm:request_success_total{{finished_reason="{reason}",model_name="m"}} 0.0' in text
    assert 'vllm:cache_config_info{block_size="16",model_name="m",num_gpu_blocks="100"} 1.0' in text
    for name in ["time_to_first_token", "inter_token_latency", "e2e_request_latency", "request_queue_time"]:
        assert f'vllm:{name}_seconds_count{{model_name="m"}} 0.0' in text


def test_each_instance_has_its_own_registry():
    first, second = ServerMetrics("a", 16, 10), ServerMetrics("b", 16, 10)
    first.record_finished_request(_finished())
    assert sum_samples(_samples(first), "vllm:request_success_total") == 1
    assert sum_samples(_samples(second), "vllm:request_success_total") == 0


def test_engine_gauges_and_cumulative_counters():
    metrics = ServerMetrics("m", 16, 10)
    metrics.record_engine_stats(_stats(num_running=3, num_waiting=2, kv_cache_usage=0.25, num_preemptions=1,
                                       prefix_cache_queries=100, prefix_cache_hits=40))
    metrics.record_engine_stats(_stats(num_running=1, kv_cache_usage=0.5, num_preemptions=1,
                                       prefix_cache_queries=150, prefix_cache_hits=64))
    # An older snapshot recorded late moves no counter back (or forward).
    metrics.record_engine_stats(_stats(num_preemptions=0, prefix_cache_queries=120, prefix_cache_hits=50))
    samples = _samples(metrics)
    assert sum_samples(samples, "vllm:num_requests_running") == 0
    assert sum_samples(samples, "vllm:num_requests_waiting") == 0
    assert sum_samples(samples, "vllm:prefix_cache_queries_total") == 150
    assert sum_samples(samples, "vllm:prefix_cache_hits_total") == 64
    assert sum_samples(samples, "vllm:num_preemptions_total") == 1


def test_finished_requests():
    metrics = ServerMetrics("m", 16, 10)
    metrics.record_finished_request(_finished(tenant="t1"))
    metrics.record_finished_request(_finished(finish_reason="stop", tenant="t1"))
    # Aborted while waiting: no prompt was processed, no token produced.
    metrics.record_finished_request(_finished(finish_reason="abort", num_generation_tokens=0, queue_time=None,
                                              time_to_first_token=None, inter_token_latencies=[]))
    samples = _samples(metrics)
    assert sum_samples(samples, "vllm:request_success_total") == 3
    assert sum_samples(samples, "vllm:request_success_total", finished_reason="abort") == 1
    assert sum_samples(samples, "vllm:prompt_tokens_total") == 14
    assert sum_samples(samples, "vllm:generation_tokens_total") == 6
    assert sum_samples(samples, "vllm:time_to_first_token_seconds_count") == 2
    assert sum_samples(samples, "vllm:inter_token_latency_seconds_count") == 4
    assert sum_samples(samples, "vllm:e2e_request_latency_seconds_count") == 3
    assert sum_samples(samples, "vllm:request_queue_time_seconds_count") == 2
    assert sum_samples(samples, "vllm:e2e_request_latency_seconds_sum") == 1.5
    assert sum_samples(samples, "kvpilot:tenant_requests_total", tenant="t1") == 2
    assert sum_samples(samples, "kvpilot:tenant_requests_total", tenant="t1", finished_reason="stop") == 1


def test_scheduling_policy_info_and_requests_in_flight():
    in_flight = [0]
    metrics = ServerMetrics("m", 16, 10, http_requests_in_flight=lambda: in_flight[0])
    metrics.record_engine_stats(_stats(scheduling_policy="priority"))
    in_flight[0] = 4
    samples = _samples(metrics)
    assert sum_samples(samples, "kvpilot:scheduling_policy_info", policy="priority") == 1
    assert sum_samples(samples, "kvpilot:scheduling_policy_info", policy="fcfs") == 0
    assert sum_samples(samples, "kvpilot:http_requests_in_flight") == 4
