"""The autoscaler's sizing against the rate-sized references (planners.py): the reference scalers
alone, then kvpilot beside oracle-reactive on a flash crowd, and its headroom on long requests
(counts and ratios of the run, no clock)."""

from __future__ import annotations

import pytest

from kvpilot.operator import autoscaler
from kvpilot.operator.sim import fleet, planners, profile, report, strategies, trace

H200 = profile.BUILTIN["h200-llama-8b"]
ENGINE = fleet.Engine(startup_seconds=60.0)


def steps(*edges: tuple[float, int]) -> planners.Rates:
    """Rates of 1 request per second per replica, with `count` requests per second from each
    edge's time on."""
    def arrivals(start: float, end: float) -> int:
        total, level, at = 0.0, 0, 0.0
        for time, count in (*edges, (float("inf"), 0)):
            overlap = max(0.0, min(end, time) - max(start, at))
            total, level, at = total + overlap * level, count, time
        return round(total)

    return planners.Rates(capacity=1.0, arrivals=arrivals)


def test_the_oracle_asks_for_the_coming_interval_at_its_start_and_never_earlier() -> None:
    rates = steps((0.0, 3), (60.0, 30))
    assert planners.recommend(planners.ORACLE, rates, 45.0, 15.0, 3) == 3  # the step is in the next interval
    assert planners.recommend(planners.ORACLE, rates, 60.0, 15.0, 3) == 30


def test_the_planner_and_the_hpa_read_the_last_interval() -> None:
    rates = steps((0.0, 3), (60.0, 30))
    assert planners.recommend(planners.TTFT_PLANNER, rates, 60.0, 15.0, 3) == 3
    assert planners.recommend(planners.TTFT_PLANNER, rates, 75.0, 15.0, 3) == 30
    # The HPA: at most 100 % or 4 pods up per period, and nothing within its 10 % tolerance.
    assert planners.recommend(planners.HPA_RPS, rates, 75.0, 15.0, 3) == 7
    assert planners.recommend(planners.HPA_RPS, rates, 90.0, 15.0, 8) == 16
    assert planners.recommend(planners.HPA_RPS, steps((0.0, 31)), 90.0, 15.0, 30) == 30


def test_a_planner_without_the_traces_rates_is_refused() -> None:
    with pytest.raises(ValueError, match="needs the trace's rates"):
        strategies.build("oracle-reactive", strategies.Settings(), initial=1, peak=1, mean=1)


def beside_the_oracle(load: trace.Trace, settings: strategies.Settings) -> dict[str, dict]:
    """oracle-reactive's and kvpilot's runs of `load`, and the trace's sizes."""
    sizes = fleet.sizes(load, H200, ENGINE, settings.target_kv_cache_usage)
    rates = planners.Rates(sizes.capacity, load.arrivals)
    found = {"sizes": sizes._asdict()}
    for name in ("oracle-reactive", "kvpilot"):
        loop = strategies.build(name, settings, initial=sizes.initial, peak=sizes.peak, mean=sizes.mean, rates=rates)
        found[name] = report.summary(fleet.simulate(load, loop, H200, ENGINE), 1.0)
    return found


@pytest.fixture(scope="module")
def crowd() -> dict[str, dict]:
    """The short-request flash crowd of the simulator's tables: 4/s, then 40/s for 15 minutes."""
    return beside_the_oracle(trace.flash_crowd(4, 2700, 512, 256, seed=0), strategies.Settings(max_replicas=64))


@pytest.fixture(scope="module")
def long_crowd() -> dict[str, dict]:
    """The long-output flash crowd of the simulator's tables: 1/s, then 10/s for 15 minutes, of
    requests that run for minutes (8,000 tokens out), at a KV target of 0.6."""
    return beside_the_oracle(trace.flash_crowd(1, 2700, 1000, 8000, seed=0),
                             strategies.Settings(max_replicas=64, target_kv_cache_usage=0.6))


def test_a_flash_crowd_is_met_within_the_targets_of_oracle_reactive(crowd: dict[str, dict]) -> None:
    oracle, kvpilot = crowd["oracle-reactive"], crowd["kvpilot"]
    # The peak needs 2 replicas at the profile's capacity: at most 1.2 times that, where the
    # backlog read as a rate asked for 64 and the per-replica drain for 3.
    assert crowd["sizes"]["peak"] == 2 and kvpilot["max_replicas"] <= 1.2 * 2
    assert kvpilot["replica_hours"] <= 1.1 * oracle["replica_hours"]
    assert kvpilot["slo_attainment"] >= oracle["slo_attainment"] - 0.03
    assert kvpilot["dropped"] == kvpilot["timed_out"] == 0


def test_a_crowd_of_long_requests_is_met_within_the_targets_of_oracle_reactive(long_crowd: dict[str, dict]) -> None:
    oracle, kvpilot = long_crowd["oracle-reactive"], long_crowd["kvpilot"]
    # The peak needs 21 replicas; the capacity measured from the first backlog asked for 64.
    assert long_crowd["sizes"]["peak"] == 21 and kvpilot["max_replicas"] <= 1.2 * 21
    assert kvpilot["replica_hours"] <= 1.1 * oracle["replica_hours"]
    assert kvpilot["slo_attainment"] >= oracle["slo_attainment"] - 0.03


def test_backlogs_that_stand_on_long_requests_placed_at_random_teach_a_headroom(monkeypatch) -> None:
    """6,000 tokens out on the 70B profile, a Service's random placement: at the capacity it
    measures, the fleet keeps replicas whose KV cache filled and whose queues stand. Learning a
    headroom from them (HEADROOM_STEP) leaves fewer requests late than sizing at the capacity."""
    load = trace.poisson(3, 7200, 1000, 6000, seed=1)
    engine = fleet.Engine(request_timeout_seconds=600.0)
    chosen = profile.BUILTIN["h200-llama-70b-fp8"]
    settings = strategies.Settings(max_replicas=40)
    sizes = fleet.sizes(load, chosen, engine, settings.target_kv_cache_usage)

    def late_and_headroom() -> tuple[int, float]:
        loop = strategies.build("kvpilot", settings, initial=sizes.initial, peak=sizes.peak, mean=sizes.mean)
        run = fleet.simulate(load, loop, chosen, engine)
        return int((~(run.first_token - load.time <= 2.0)).sum()), loop.memory.headroom

    learnt_late, learnt = late_and_headroom()
    monkeypatch.setattr(autoscaler, "HEADROOM_STEP", 0.0)
    flat_late, flat = late_and_headroom()
    assert flat == 1.0 and learnt > 1.0
    assert learnt_late < flat_late / 1.5
