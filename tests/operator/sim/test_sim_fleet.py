"""The fleet simulator's acceptance: determinism, conservation, Little's law, the flash crowd and
the two-tenant mix, each on a short trace."""

from __future__ import annotations

import dataclasses
import heapq
import math

import numpy as np
import pytest

from kvpilot.operator.sim import fleet, profile, report, strategies, trace
from kvpilot.operator.sim import replica as replica_model
from kvpilot.operator.sim.fleet import DROPPED, PENDING, SERVED, TIMED_OUT

_TIMINGS = ("wall_seconds", "cpu_seconds", "events_per_second", "events_per_cpu_second")
H200 = profile.BUILTIN["h200-llama-8b"]
ENGINE = fleet.Engine(startup_seconds=60.0)


def run(load: trace.Trace, name: str, settings: strategies.Settings, *, chosen: profile.Profile = H200,
        engine: fleet.Engine = ENGINE, **options) -> fleet.Run:
    sizes = fleet.sizes(load, chosen, engine, settings.target_kv_cache_usage)
    loop = strategies.build(name, settings, initial=sizes.initial, peak=sizes.peak, mean=sizes.mean)
    return fleet.simulate(load, loop, chosen, engine, **options)


def test_the_same_seed_gives_the_same_results_and_another_seed_does_not():
    settings = strategies.Settings(max_replicas=20)
    first, second, other = (run(trace.two_tenant(20, 900, 256, 128, seed=seed), "kvpilot", settings,
                                priorities=[0, 1], seed=seed) for seed in (1, 1, 2))
    np.testing.assert_array_equal(first.first_token, second.first_token)
    np.testing.assert_array_equal(first.finish, second.finish)
    np.testing.assert_array_equal(first.outcome, second.outcome)
    assert first.series == second.series
    same = {k: v for k, v in report.summary(first, 1.0).items() if k not in _TIMINGS}
    again = {k: v for k, v in report.summary(second, 1.0).items() if k not in _TIMINGS}
    assert same == again
    assert len(other.trace) != len(first.trace) or not np.array_equal(other.finish, first.finish)


def test_every_arrival_ends_once_and_no_pool_overflows_under_a_flash_crowd_with_a_small_pool():
    small = dataclasses.replace(H200, num_gpu_blocks=600)
    load = trace.flash_crowd(3, 1200, 1024, 512, seed=4)
    engine = fleet.Engine(max_num_seqs=64, request_timeout_seconds=30.0, startup_seconds=60.0)
    # check_invariants: each interval, each replica's exact block count <= its bound <= the pool;
    # at the end, no request left pending; a request ending twice raises at once.
    result = run(load, "queue-only", strategies.Settings(max_replicas=4), chosen=small, engine=engine,
                 check_invariants=True)
    outcomes = np.bincount(result.outcome, minlength=4)
    assert outcomes[PENDING] == 0
    assert outcomes[SERVED] + outcomes[DROPPED] + outcomes[TIMED_OUT] == len(load)
    assert outcomes[SERVED] > 0 and outcomes[TIMED_OUT] > 0 and result.preemptions > 0
    served = result.outcome == SERVED
    assert (result.finish[served] >= result.first_token[served]).all()
    assert (result.first_token[served] >= load.time[served]).all()
    assert np.isnan(result.first_token[result.outcome == DROPPED]).all()


def test_requests_are_dropped_while_no_replica_is_ready():
    load = trace.poisson(5, 300, 128, 64, seed=0)
    # All replicas go at once (min 1, but the static count is the one asked for) and none is back.
    loop = strategies.build("static-peak", strategies.Settings(), initial=0, peak=0, mean=0)
    result = fleet.simulate(load, loop, H200, ENGINE, check_invariants=True)
    assert (result.outcome == DROPPED).all() and result.replica_seconds == 0


def test_littles_law_holds_on_a_steady_poisson_run():
    load = trace.poisson(30, 3600, 512, 256, seed=7)
    settings = strategies.Settings(interval_seconds=5.0)
    result = run(load, "static-peak", settings)
    assert (result.outcome == SERVED).all()
    in_system = float(np.mean(result.series.in_system))  # sampled every interval
    mean_latency = float(np.mean(result.finish - load.time))
    assert in_system == pytest.approx(load.mean_rate() * mean_latency, rel=0.05)
    assert in_system > 10  # a real load, not an empty fleet


def test_a_flash_crowd_scales_the_composite_up_before_the_queue_only_baseline_breaches_its_slo():
    """Long outputs (reasoning-style) at targetKVCacheUsage 0.6: the KV pools fill while the
    queues are still short. With short outputs both react in the same interval (BENCHMARKS.md)."""
    load = trace.flash_crowd(1.0, 2700, 1000, 8000, seed=3)
    engine = fleet.Engine(startup_seconds=60.0)
    sizes = fleet.sizes(load, H200, engine, 0.6)
    settings = strategies.Settings(min_replicas=sizes.initial, max_replicas=64, target_kv_cache_usage=0.6)
    flash = load.duration / 3
    composite, queue_only = (run(load, name, settings, engine=engine) for name in ("kvpilot", "queue-only"))

    def first_scale_up(result: fleet.Run) -> float:
        times, desired = np.array(result.series.time), np.array(result.series.desired)
        return float(times[(times >= flash) & (desired > sizes.initial)][0])

    ttft = queue_only.first_token - load.time
    breach = float(load.time[(load.time >= flash) & ~(ttft <= 1.0)][0])
    assert first_scale_up(composite) < breach < first_scale_up(queue_only)
    slo = [report.summary(r, 1.0)["slo_attainment"] for r in (composite, queue_only)]
    assert slo[0] > slo[1]


def test_the_auto_tuner_gives_the_interactive_tenant_a_lower_ttft_p99_than_fcfs_at_the_same_cost():
    load = trace.two_tenant(20, 1800, 256, 128, seed=5)
    settings = strategies.Settings(max_replicas=8)
    fcfs, auto = (report.summary(run(load, name, settings, priorities=[-1, 0]), 1.0)
                  for name in ("static-mean+fcfs", "static-mean"))
    assert load.tenants == ("interactive", "batch")
    assert auto["replica_hours"] == fcfs["replica_hours"]
    assert auto["ttft_p99_s_by_tenant"]["interactive"] < fcfs["ttft_p99_s_by_tenant"]["interactive"]


def test_the_auto_tuner_puts_the_interactive_tenant_first_while_the_flood_waits_for_replicas():
    """Autoscaled below maxReplicas: the flood's queue builds on the replica ready while the ones
    asked for start, and under priority the interactive trickle no longer waits behind it."""
    load = trace.two_tenant(20, 1800, 256, 128, seed=5)
    settings = strategies.Settings(max_replicas=8)
    fcfs, auto = (run(load, name, settings, priorities=[-1, 0]) for name in ("kvpilot+fcfs", "kvpilot"))
    assert not any(fcfs.series.priority) and any(auto.series.priority)
    interactive = load.tenant == 0
    late = [np.count_nonzero(interactive & ~(r.first_token - load.time <= 1.0)) for r in (fcfs, auto)]
    assert late[1] < late[0] / 2


def test_unknown_strategy_is_refused():
    with pytest.raises(ValueError, match="unknown strategy 'hpa'"):
        strategies.build("hpa", strategies.Settings(), initial=1, peak=1, mean=1)


def test_replicas_played_between_control_events_match_one_clock_over_every_step():
    """The fleet plays each replica's arrivals and steps on its own between control events; a
    loop over one heap of every replica's step events, in time order, gives the same times."""
    load = trace.poisson(60, 600, 512, 256, seed=11)
    replicas = 3
    loop = strategies.build("static-peak", strategies.Settings(), initial=replicas, peak=replicas, mean=replicas)
    result = fleet.simulate(load, loop, H200, ENGINE, seed=11)

    first, finish = np.full(len(load), np.nan), np.full(len(load), np.nan)

    class Ledger:
        def first_token(self, request, now):
            first[request.index] = now

        def finished(self, request, now):
            finish[request.index] = now

        def timed_out(self, request, now):
            raise AssertionError("no timeouts on this load")

    fleet_of = [replica_model.Replica(f"r{i}", H200, max_num_seqs=ENGINE.max_num_seqs, timeout=1e9,
                                      max_num_batched_tokens=ENGINE.max_num_batched_tokens, ledger=Ledger())
                for i in range(replicas)]
    steps: list[tuple[float, int, int]] = []  # (when, replica, version): a later plan voids the earlier
    version = [0] * replicas

    def schedule(rid: int, when: float | None) -> None:
        if when is not None:
            version[rid] += 1
            heapq.heappush(steps, (when, rid, version[rid]))

    def run_steps_before(time: float) -> None:
        while steps and steps[0][0] < time:
            when, rid, v = heapq.heappop(steps)
            if v == version[rid]:
                schedule(rid, fleet_of[rid].advance(when))

    routes = np.random.default_rng(11).random(len(load))
    for i, (time, prompt, output) in enumerate(zip(load.time.tolist(), load.prompt.tolist(), load.output.tolist())):
        run_steps_before(time)
        rid = int(routes[i] * replicas)
        schedule(rid, fleet_of[rid].add(replica_model.Request(i, time, prompt, output, 0), time))
    run_steps_before(math.inf)
    assert (result.outcome == SERVED).all()
    np.testing.assert_array_equal(result.first_token, first)
    np.testing.assert_array_equal(result.finish, finish)


def test_the_frontend_delay_reaches_the_replica_late_and_counts_in_the_ttft():
    # Requests far apart on one static replica: none waits for another, so the delay adds to
    # each one's first token and finish exactly, and the TTFT still counts from the trace's time.
    load = trace.poisson(0.05, 600, 128, 16, seed=3)
    settings = strategies.Settings(max_replicas=1)
    direct = run(load, "static-peak", settings)
    delayed = run(load, "static-peak", settings, chosen=dataclasses.replace(H200, frontend_s=0.25))
    assert (direct.outcome == SERVED).all() and (delayed.outcome == SERVED).all()
    np.testing.assert_allclose(delayed.first_token - direct.first_token, 0.25, rtol=0, atol=1e-9)
    np.testing.assert_allclose(delayed.finish - direct.finish, 0.25, rtol=0, atol=1e-9)
    with pytest.raises(ValueError, match="frontend_s"):
        dataclasses.replace(H200, frontend_s=-0.1)
