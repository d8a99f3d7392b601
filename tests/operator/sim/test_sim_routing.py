"""Multi-turn traces, and the router's strategies placing them on a simulated fleet."""

from __future__ import annotations

import numpy as np
import pytest

from kvpilot.operator.sim import cli, fleet, profile, report, routing, strategies, trace
from kvpilot.operator.sim import replica as replica_model

H200 = profile.BUILTIN["h200-llama-8b"]


class Ledger:
    def first_token(self, request, now): pass
    def finished(self, request, now): pass
    def timed_out(self, request, now): pass


def test_each_turn_sends_the_conversation_so_far_then_its_own_message():
    load = trace.multi_turn(2.0, 600.0, 100, 50, seed=1, turns=4, think_seconds=10.0, system_tokens=300)
    assert load.shared_tokens == 300 and np.all(np.diff(load.time) >= 0)
    turns_seen = 0
    for conversation in np.unique(load.conversation):
        turns = np.flatnonzero(load.conversation == conversation)  # in time order
        prompts, outputs = load.prompt[turns], load.output[turns]
        # A message of 50 to 150 tokens after the system prompt, then after each earlier exchange.
        assert 300 + 50 <= prompts[0] <= 300 + 150
        grown = prompts[1:] - (prompts[:-1] + outputs[:-1])
        assert np.all((grown >= 50) & (grown <= 150))
        turns_seen = max(turns_seen, len(turns))
    assert turns_seen > 3


def test_new_conversations_follow_the_pattern():
    crowd = trace.multi_turn(5.0, 900.0, 100, 50, seed=0, turns=1, pattern="flash-crowd")
    firsts = crowd.time[np.unique(crowd.conversation, return_index=True)[1]]
    before, during = np.count_nonzero(firsts < 300), np.count_nonzero((firsts >= 360) & (firsts < 600))
    assert during > 5 * before


def run(load: trace.Trace, routing_name: str) -> dict:
    loop = strategies.build("static-peak", strategies.Settings(), initial=8, peak=8, mean=8)
    result = fleet.simulate(load, loop, H200, fleet.Engine(), routing_name=routing_name, check_invariants=True)
    return report.summary(result, ttft_slo=1.0)


def test_prefix_aware_routing_finds_more_of_the_prompts_cached_and_starts_sooner_than_round_robin():
    load = trace.multi_turn(24.0, 240.0, 300, 40, seed=0, turns=6, think_seconds=5.0, system_tokens=256)
    aware, robin = run(load, "prefix-aware"), run(load, "round-robin")
    assert aware["served"] == robin["served"] == len(load)
    # Round-robin finds the system prompt everywhere and a conversation's own blocks one time in 8.
    assert aware["prefix_hit_rate"] > robin["prefix_hit_rate"] + 0.15
    assert aware["ttft_p50_s"] < 0.75 * robin["ttft_p50_s"]


def test_every_routing_serves_every_request_of_a_trace_without_conversations():
    load = trace.poisson(20.0, 60.0, 200, 50, seed=0)
    for name in routing.NAMES:
        summary = run(load, name)
        assert summary["served"] == len(load) and summary["prefix_hit_rate"] is None


def test_the_command_line_knows_the_routers_strategies():
    assert cli.ROUTINGS == routing.NAMES


def test_unknown_routing_is_refused():
    with pytest.raises(ValueError):
        run(trace.poisson(1.0, 10.0, 10, 10, seed=0), "sticky")


def test_the_router_reads_the_engines_counts_at_the_interval_unless_fresh():
    replicas = [replica_model.Replica(f"r{i}", H200, max_num_seqs=8, max_num_batched_tokens=8192, timeout=60.0,
                                      ledger=Ledger()) for i in range(2)]
    for index in range(3):
        replicas[0].add(replica_model.Request(index, 0.0, 100, 2, 0), 0.0)
    replicas[1].add(replica_model.Request(3, 0.0, 100, 1000, 0), 0.0)
    interval = routing.Router(routing.RoutingStrategy.LEAST_LOADED)
    fresh = routing.Router(routing.RoutingStrategy.LEAST_LOADED, fresh_counts=True)
    for router in (interval, fresh):
        router.read(replicas, [0, 1])  # r0 holds 3 requests, r1 one
    replicas[0].play((), 10.0)  # r0's end; r1's is minutes away
    assert replicas[0].empty()
    for router in (interval, fresh):
        router.ran(0)
    # As of the reading r0 still carries 3 requests; as of the request, none.
    assert interval.pick(replica_model.Request(4, 10.0, 100, 2, 0), replicas, [0, 1]) == 1
    assert fresh.pick(replica_model.Request(4, 10.0, 100, 2, 0), replicas, [0, 1]) == 0
