"""Reading metrics, the pure half: PromQL built in one place with escaped labels, Prometheus
answers and pod pages parsed, and every kind of bad input a Problem, never an exception."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest

from kvpilot.operator import samples
from kvpilot.runtime.router.metrics import RouterMetrics
from kvpilot.runtime.server.metrics import ServerMetrics


def engine_page(kv: float, waiting: int, running: int, ttfts: tuple[float, ...] = ()) -> str:
    """What a kvpilot engine's /metrics serves (its own renderer)."""
    page = ServerMetrics("tiny", 16, 100)
    page.kv_cache_usage.set(kv)
    page.num_requests_waiting.set(waiting)
    page.num_requests_running.set(running)
    for ttft in ttfts:
        page.time_to_first_token.observe(ttft)
    return page.render().decode()


def gauges(sample: samples.PodSample) -> samples.PodSample:
    """The sample without its latency histograms."""
    return dataclasses.replace(sample, ttft=None, itl=None)


def test_an_engine_page_is_one_sample() -> None:
    page = engine_page(0.25, 3, 7, ttfts=(0.03, 0.3, 0.3, 30.0))
    assert samples.from_page("qwen-0", page, 100.0) == samples.PodSample("qwen-0", 0.25, 3, 7, 100.0, num_finished=0.0)
    # With latencies (autoscaling.targets): the histograms' cumulative buckets, by bound, up to +Inf.
    sample = samples.from_page("qwen-0", page, 100.0, latencies=True)
    assert gauges(sample) == samples.PodSample("qwen-0", 0.25, 3, 7, 100.0, num_finished=0.0)
    ttft = dict(sample.ttft)
    assert (ttft[0.02], ttft[0.04], ttft[0.25], ttft[0.5], ttft[20.0], ttft[40.0], ttft[math.inf]) == (0, 1, 1, 3, 3, 4, 4)
    assert sample.itl[-1] == (math.inf, 0)


def test_a_histogram_that_is_not_cumulative_is_invalid() -> None:
    page = engine_page(0.25, 3, 7, ttfts=(0.3,)).replace(
        'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="tiny"} 1.0',
        'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="tiny"} 0.0')
    problem = samples.from_page("qwen-0", page, 100.0, latencies=True)
    assert problem.reason == samples.INVALID and "vllm:time_to_first_token_seconds histogram" in problem.message


def test_finished_requests_are_summed_over_reasons_and_optional() -> None:
    page = engine_page(0.25, 3, 7)
    page = page.replace('finished_reason="stop",model_name="tiny"} 0.0', 'finished_reason="stop",model_name="tiny"} 40.0')
    page = page.replace('finished_reason="length",model_name="tiny"} 0.0', 'finished_reason="length",model_name="tiny"} 2.0')
    assert samples.from_page("qwen-0", page, 100.0).num_finished == 42
    # An engine without the counter still gives a sample; the autoscaler then has no rate.
    gauges_only = "\n".join(line for line in page.splitlines() if "request_success" not in line) + "\n"
    assert gauges(samples.from_page("qwen-0", gauges_only, 100.0)) == samples.PodSample("qwen-0", 0.25, 3, 7, 100.0)
    negative = page.replace('"length",model_name="tiny"} 2.0', '"length",model_name="tiny"} -50.0')
    assert samples.from_page("qwen-0", negative, 100.0).reason == samples.INVALID


@pytest.mark.parametrize(("page", "reason", "words"), [
    ("<html><body>502 Bad Gateway</body></html>", samples.INVALID, "is not Prometheus text"),
    ('vllm:kv_cache_usage_perc{model_name="a" 0.5\n', samples.INVALID, "is not Prometheus text"),
    ("", samples.MISSING, "reports no vllm:kv_cache_usage_perc, vllm:num_requests_waiting"),
    ("up 1\n", samples.MISSING, "reports no vllm:kv_cache_usage_perc"),
    (engine_page(0.5, 0, 0).replace('kv_cache_usage_perc{model_name="tiny"} 0.5', 'kv_cache_usage_perc{model_name="tiny"} NaN'),
     samples.INVALID, "vllm:kv_cache_usage_perc = nan"),
    (engine_page(0.5, 0, 0).replace('waiting{model_name="tiny"} 0.0', 'waiting{model_name="tiny"} -3'),
     samples.INVALID, "vllm:num_requests_waiting = -3.0"),
    (engine_page(0.5, 0, 0).replace('kv_cache_usage_perc{model_name="tiny"} 0.5', 'kv_cache_usage_perc{model_name="tiny"} 1.5'),
     samples.INVALID, "vllm:kv_cache_usage_perc = 1.5"),
    (engine_page(0.5, 0, 0).replace('waiting{model_name="tiny"} 0.0', 'waiting{model_name="tiny"} +Inf'),
     samples.INVALID, "vllm:num_requests_waiting = inf"),
])
def test_bad_pages_are_problems(page: str, reason: str, words: str) -> None:
    problem = samples.from_page("qwen-0", page, 0.0)
    assert isinstance(problem, samples.Problem), problem
    assert problem.reason == reason and words in problem.message and "qwen-0" in problem.message


def test_series_of_several_models_are_summed() -> None:
    page = engine_page(0.25, 1, 2) + "\n".join([
        'vllm:kv_cache_usage_perc{model_name="other"} 0.5',
        'vllm:num_requests_waiting{model_name="other"} 4',
    ]) + "\n"
    sample = samples.from_page("p", page, 0.0)
    assert isinstance(sample, samples.PodSample) and (sample.kv_cache_usage, sample.num_waiting) == (0.75, 5)


def test_queries_select_the_pods_with_escaped_labels() -> None:
    found = samples.queries('ml"x', ["qwen-7d9f.a", 'odd"\\pod'], "30s")
    assert set(found) == {*samples.METRICS, samples.REQUESTS_FINISHED, "observed_at"}
    selector = r'{namespace="ml\"x",pod=~"odd\"\\\\pod|qwen\\-7d9f\\.a"}'
    assert found["vllm:kv_cache_usage_perc"] == f"max by (pod) (avg_over_time(vllm:kv_cache_usage_perc{selector}[30s]))"
    assert found["observed_at"] == f"max by (pod) (timestamp(vllm:kv_cache_usage_perc{selector}))"
    assert found["vllm:request_success_total"] == f"sum by (pod) (vllm:request_success_total{selector})"


def answer(*series: tuple[str, str]) -> dict:
    return {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"pod": pod}, "value": [1700000000.0, value]} for pod, value in series]}}


def test_query_answers_become_samples_per_pod() -> None:
    vectors = {
        "vllm:kv_cache_usage_perc": samples.vector(answer(("a", "0.5"), ("b", "NaN"))),
        "vllm:num_requests_waiting": samples.vector(answer(("a", "2"), ("b", "0"))),
        "vllm:num_requests_running": samples.vector(answer(("a", "1"), ("b", "0"))),
        "observed_at": samples.vector(answer(("a", "1699999999.5"), ("b", "1699999999.5"))),
    }
    reading = samples.from_vectors(["a", "b", "c"], vectors)
    assert reading.samples == {"a": samples.PodSample("a", 0.5, 2, 1, 1699999999.5)}
    counted = samples.from_vectors(["a"], {**vectors, "vllm:request_success_total": samples.vector(answer(("a", "9")))})
    assert counted.samples["a"].num_finished == 9
    assert reading.problems["b"].reason == samples.INVALID and math.isnan(vectors["vllm:kv_cache_usage_perc"]["b"])
    assert reading.problems["c"] == samples.Problem(
        samples.MISSING, "Prometheus has no vllm:kv_cache_usage_perc of pod c")


@pytest.mark.parametrize("bad", [
    None, [], "ok", {"status": "error", "errorType": "bad_data", "error": "parse error"},
    {"status": "success", "data": {"resultType": "matrix", "result": []}},
    {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [0, "1"]}]}},
    {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {"pod": "a"}, "value": "x"}]}},
    {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {"pod": "a"}, "value": [0, "one"]}]}},
])
def test_malformed_answers_are_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        samples.vector(bad)


def test_only_the_wanted_families_are_parsed() -> None:
    # A family whose name merely starts like a wanted one is another family; a broken line of a
    # family the sample does not use is no reason to refuse the page's gauges.
    page = engine_page(0.25, 1, 2) + "\n".join([
        'vllm:num_requests_waiting_by_priority{priority="0"} 9',
        'vllm:e2e_request_latency_seconds_bucket{le="1" 3',
    ]) + "\n"
    assert gauges(samples.from_page("p", page, 0.0)) == samples.PodSample("p", 0.25, 1, 2, 0.0, num_finished=0.0)


def router_page(held: int) -> str:
    """What a kvpilot router's /metrics serves (its own renderer), with no replica known."""
    return RouterMetrics(SimpleNamespace(replicas={}), lambda: held).render().decode()  # type: ignore[arg-type]


def test_a_router_page_is_its_held_count() -> None:
    assert samples.held_from_page("r0", router_page(3)) == 3


@pytest.mark.parametrize(("page", "reason", "words"), [
    ("<html>502</html>", samples.INVALID, "router pod r0: /metrics is not Prometheus text"),
    (engine_page(0.5, 0, 0), samples.MISSING, "router pod r0 reports no kvpilot:router_requests_held"),
    (router_page(0).replace("kvpilot:router_requests_held 0.0", "kvpilot:router_requests_held NaN"),
     samples.INVALID, "kvpilot:router_requests_held = nan"),
])
def test_bad_router_pages_are_problems(page: str, reason: str, words: str) -> None:
    problem = samples.held_from_page("r0", page)
    assert isinstance(problem, samples.Problem) and problem.reason == reason and words in problem.message, problem


def test_the_fleet_holds_what_every_router_holds() -> None:
    assert samples.total_held({"r0": 2.0, "r1": 1.0}) == 3
    broken = samples.Problem(samples.MISSING, "router pod r1: GET /metrics failed")
    # A router not read may hold the only request there is.
    assert samples.total_held({"r0": 0.0, "r1": broken}) == broken
    assert samples.total_held({}) == samples.Problem(samples.MISSING, "no router is ready to be read")


def test_prometheus_held_counts_need_every_router() -> None:
    query = samples.held_query("ml", ["qwen-router-a", "qwen-router-b"])
    assert query == ('max by (pod) (kvpilot:router_requests_held{namespace="ml",'
                     'pod=~"qwen\\\\-router\\\\-a|qwen\\\\-router\\\\-b"})')
    assert samples.held_from_vector(["a", "b"], {"a": 1.0, "b": 2.0}) == 3
    missing = samples.held_from_vector(["a", "b"], {"a": 1.0})
    assert isinstance(missing, samples.Problem) and missing.reason == samples.MISSING and "b" in missing.message


def test_a_counter_is_read_from_a_page_where_it_is_and_none_elsewhere() -> None:
    page = engine_page(0.25, 3, 7).replace('vllm:prefix_cache_hits_total{model_name="tiny"} 0.0',
                                           'vllm:prefix_cache_hits_total{model_name="tiny"} 96.0')
    assert samples.counter_from_page(page, "vllm:prefix_cache_hits_total") == 96
    assert samples.counter_from_page(page, "vllm:nothing_total") is None
    assert samples.counter_from_page("<html>busy</html>", "vllm:prefix_cache_hits_total") is None
