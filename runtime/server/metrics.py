"""Prometheus metrics under vLLM's names, so that dashboards, KEDA triggers and gateways work unchanged.

`ServerMetrics` is the StatLogger AsyncLLM feeds: engine gauges and cumulative counters after
steps, and one record per finished (or aborted) choice. Each instance owns its registry, so
several apps can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvpilot.runtime.config import SchedulingPolicy
from kvpilot.runtime.server.http_responses import HttpResponses

if TYPE_CHECKING:
    from kvpilot.runtime.engine.output_processor import FinishedRequestStats
    from kvpilot.runtime.engine.messages import EngineStats

# vLLM V1's bucket boundaries (vllm/v1/metrics/loggers.py), so that dashboards built on its
# histograms read ours the same way.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# Inter-token latency and each request's mean time per output token.
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(largest: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `largest`: vLLM's buckets for token counts (to max_model_len)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > largest:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


FINISH_REASONS = ("stop", "length", "abort")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    def __init__(self, model_name: str, block_size: int, num_gpu_blocks: int,
                 http_requests_in_flight: Callable[[], int] = lambda: 0, *, max_model_len: int = 8192) -> None:
        """`max_model_len` is where the token-count buckets stop, as in vLLM (the server passes its own)."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        registry = self.registry

        # Metrics labelled by model_name only are bound to it once, so every series exists
        # (at 0) from the first scrape.
        def gauge(name: str, doc: str):
            return Gauge(name, doc, ["model_name"], registry=registry).labels(model_name)

        def counter(name: str, doc: str):
            return Counter(name, doc, ["model_name"], registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=registry).labels(model_name)

        self.num_requests_running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means every block is in use.")
        cache_info = Gauge("vllm:cache_config_info", "The KV-cache configuration (value 1).",
                           ["model_name", "block_size", "num_gpu_blocks"], registry=registry)
        cache_info.labels(model_name, str(block_size), str(num_gpu_blocks)).set(1)
        gauge("kvpilot:http_requests_in_flight",
              "HTTP requests being served (what a SIGTERM drain waits for).").set_function(http_requests_in_flight)
        self._scheduling_policy = Gauge("kvpilot:scheduling_policy_info",
                                        "The engine's scheduling policy: 1 for the current one.",
                                        ["model_name", "policy"], registry=registry)
        self._policy_shown: SchedulingPolicy | None = None

        # The engine reports these cumulatively; they are exported by the delta.
        self._engine_counters = {
            "prefix_cache_queries": counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
            "prefix_cache_hits": counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."),
            "num_preemptions": counter("vllm:num_preemptions", "Preemptions (requests recomputed later)."),
        }
        self._engine_totals = dict.fromkeys(self._engine_counters, 0)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of scheduled requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.slow_client_aborts = counter("kvpilot:slow_client_aborts",
                                          "Streams aborted because their client stopped reading.")
        self._request_success = Counter("vllm:request_success", "Finished requests (choices), by finish reason.",
                                        ["model_name", "finished_reason"], registry=registry)
        for reason in FINISH_REASONS:
            self._request_success.labels(model_name, reason)
        self._tenant_requests = Counter("kvpilot:tenant_requests", "Finished requests (choices) per tenant.",
                                        ["model_name", "tenant", "finished_reason"], registry=registry)
        self.http_responses = HttpResponses(registry)

        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds", "Time to the first token.",
                                             _TTFT_BUCKETS)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds", "Time between tokens.",
                                             _TPOT_BUCKETS)
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Each request's decode time over its output tokens after the first.", _TPOT_BUCKETS)
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds",
                                             "Time from arrival to the last token.", _REQUEST_BUCKETS)
        self.request_queue_time = histogram("vllm:request_queue_time_seconds",
                                            "Time in the engine's queue before first scheduled.", _REQUEST_BUCKETS)
        self.request_prefill_time = histogram("vllm:request_prefill_time_seconds",
                                              "Time from first scheduled to the first token.", _REQUEST_BUCKETS)
        self.request_decode_time = histogram("vllm:request_decode_time_seconds",
                                             "Time from the first token to the last.", _REQUEST_BUCKETS)
        self.request_inference_time = histogram("vllm:request_inference_time_seconds",
                                                "Time from first scheduled to the last token.", _REQUEST_BUCKETS)

        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Generated tokens per request.", token_buckets)
        self.request_params_max_tokens = histogram("vllm:request_params_max_tokens",
                                                   "The max_tokens request parameter.", token_buckets)
        self.request_params_n = histogram("vllm:request_params_n", "The n request parameter.", _N_BUCKETS)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Tokens per engine step: prompts that got their first token, plus "
                                          "the tokens generated.", _ITERATION_TOKEN_BUCKETS)

    def record_engine_stats(self, stats: EngineStats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        # Pushed after every engine step: the info gauge's series are looked up only when it changes.
        if stats.scheduling_policy != self._policy_shown:
            self._policy_shown = stats.scheduling_policy
            for policy in SchedulingPolicy:
                self._scheduling_policy.labels(self.model_name, policy).set(1 if policy == stats.scheduling_policy else 0)
        for name, counter in self._engine_counters.items():
            total = getattr(stats, name)
            # A scrape's own get_stats result can be recorded after newer pushed stats: never go back.
            if total > self._engine_totals[name]:
                counter.inc(total - self._engine_totals[name])
                self._engine_totals[name] = total

    def record_finished_request(self, stats: FinishedRequestStats) -> None:
        self._request_success.labels(self.model_name, stats.finish_reason).inc()
        if stats.tenant is not None:
            self._tenant_requests.labels(self.model_name, stats.tenant, stats.finish_reason).inc()
        # A request aborted while still waiting never had its prompt processed.
        if stats.queue_time is not None:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
            self.request_queue_time.observe(stats.queue_time)
        self.generation_tokens.inc(stats.num_generation_tokens)
        if stats.time_to_first_token is not None:
            self.time_to_first_token.observe(stats.time_to_first_token)
        for latency in stats.inter_token_latencies:
            self.inter_token_latency.observe(latency)
        self.e2e_request_latency.observe(stats.e2e_latency)
        self.request_prompt_tokens.observe(stats.num_prompt_tokens)
        self.request_generation_tokens.observe(stats.num_generation_tokens)
        if stats.max_tokens is not None:
            self.request_params_max_tokens.observe(stats.max_tokens)
        if stats.n is not None:
            self.request_params_n.observe(stats.n)
        # The phases of a request that produced a token (vLLM's definitions; its time per output
        # token is 0 for a single token).
        if stats.prefill_time is not None:
            self.request_prefill_time.observe(stats.prefill_time)
            self.request_decode_time.observe(stats.decode_time)
            self.request_inference_time.observe(stats.prefill_time + stats.decode_time)
            later_tokens = stats.num_generation_tokens - 1
            self.request_time_per_output_token.observe(stats.decode_time / later_tokens if later_tokens else 0.0)

    def record_iteration(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        self.iteration_tokens.observe(num_prompt_tokens + num_generation_tokens)

    def count_slow_client(self) -> None:
        self.slow_client_aborts.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
