"""Three `kvpilot serve` replicas publishing their KV-cache events, and routers in front of them.

The oracle is one engine serving everything: the same answers, and the prefix-cache hits the
engines' own counters report. Each run salts its prompts differently (cache_salt), so that no run
hits blocks another run cached.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from kvpilot.runtime.benchmarks.conversations import conversation_questions, run_conversations
from server_harness import HTTP_TIMEOUT_S, _free_port, sse_events, start_server, wait_until

pytestmark = pytest.mark.timeout(600)

HITS = "vllm:prefix_cache_hits_total"


def kv_events_config() -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"tcp://127.0.0.1:{_free_port()}", "replay_endpoint": f"tcp://127.0.0.1:{_free_port()}"})


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fleet")
    backends = workdir / "backends"
    # The bound on loads off: placed by their caches alone, two routers must agree on every turn.
    # With it, a stale load reading (a turn that ended since) moves a conversation now and then,
    # which one engine never does; tests/runtime/router/test_picking.py covers the bound.
    router_flags = [("--bounded-load-factor", "1000")] * 2 + [("--routing-strategy", "round-robin")]
    with ThreadPoolExecutor(3) as pool:
        replicas = list(pool.map(lambda _: start_server(tiny_llama_dir, workdir, "--served-model-name", "tiny",
                                                        "--kv-events-config", kv_events_config()), range(3)))
        backends.write_text("".join(f"{r.base_url}\n" for r in replicas))
        *routers, round_robin = pool.map(lambda flags: start_server(tiny_llama_dir, workdir, "--backends-file",
                                                                    str(backends), *flags, subcommand="router"),
                                         router_flags)
    everything = [*replicas, *routers, round_robin]
    for router in [*routers, round_robin]:
        wait_until(lambda: router.metric("kvpilot:router_kv_events_synced") == 3, timeout=60,
                   what="the routers to follow every replica's KV-cache events")
    yield replicas, routers, round_robin
    for process in everything:
        process.stop()


def fleet_hits(replicas) -> float:
    return sum(replica.metric(HITS) for replica in replicas if replica.process.poll() is None)


def test_multi_turn_conversations_are_answered_as_by_one_engine_with_its_prefix_hits(fleet):
    replicas, routers, round_robin = fleet
    questions = conversation_questions(num_conversations=12, num_turns=4, words_per_turn=12, seed=0)

    def run(urls, salt):
        before = fleet_hits(replicas)
        turns = asyncio.run(run_conversations(urls, questions, model="tiny", max_tokens=12, concurrency=4,
                                              cache_salt=salt))
        return [[t.answer for t in conversation] for conversation in turns], fleet_hits(replicas) - before

    one_engine, one_engine_hits = run([replicas[0].base_url], "one engine")
    routed, routed_hits = run([r.base_url for r in routers], "prefix-aware")
    rotated, rotated_hits = run([round_robin.base_url], "round-robin")

    assert routed == one_engine
    assert rotated == one_engine
    assert one_engine_hits > 0
    # The turns crossed both routers, which placed each conversation alike (measured: all the hits;
    # the margin is for a KV event that reaches one router after the next turn).
    assert routed_hits >= 0.95 * one_engine_hits, (routed_hits, one_engine_hits)
    # Round-robin finds a conversation's blocks only where an earlier turn happened to run (a third
    # of the time for turn 2, more for later turns, partly).
    assert rotated_hits <= 0.7 * one_engine_hits, (rotated_hits, one_engine_hits)
    # The routers predicted hits, and show each replica's own count beside their predictions.
    assert sum(router.metric("kvpilot:router_prefix_hit_blocks_predicted_total") for router in routers) > 0
    for replica in replicas:
        wait_until(lambda: routers[0].metric("kvpilot:router_engine_prefix_cache_hits", replica=replica.base_url)
                   == replica.metric(HITS), timeout=10, what="the router's reading of a replica's hits")
    print(f"prefix hits (tokens): one engine {one_engine_hits:.0f}, prefix-aware {routed_hits:.0f}, "
          f"round-robin {rotated_hits:.0f}")


def test_a_client_that_leaves_aborts_its_request_on_the_replica(fleet):
    replicas, routers, _ = fleet
    aborted_before = sum(r.metric("vllm:request_success_total", finished_reason="abort") for r in replicas)
    body = {"model": "tiny", "prompt": "a long answer", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{routers[0].base_url}/v1/completions", json=body, timeout=HTTP_TIMEOUT_S) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
    wait_until(lambda: sum(r.metric("vllm:request_success_total", finished_reason="abort") for r in replicas)
               > aborted_before, timeout=30, what="the replica to abort the request its client left")
    wait_until(lambda: routers[0].metric("kvpilot:router_requests_in_flight") == 0, timeout=30,
               what="the router to count the request finished")


def test_killing_a_replicas_engine_mid_run_loses_no_request_and_greedy_streams_resume(fleet):
    replicas, routers, _ = fleet
    prompts = [f"story number {i} begins" for i in range(6)]
    body = {"model": "tiny", "max_tokens": 160, "ignore_eos": True, "temperature": 0}
    # What each stream must be: the same request, run whole on one replica.
    expected = [httpx.post(f"{replicas[0].base_url}/v1/completions", json={**body, "prompt": p},
                           timeout=HTTP_TIMEOUT_S).json()["choices"][0]["text"] for p in prompts]
    streamed: dict[int, list] = {}
    unary: dict[int, httpx.Response] = {}
    started = threading.Barrier(len(prompts) + 1)

    def stream(index: int) -> None:
        url = routers[index % 2].base_url
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "prompt": prompts[index], "stream": True},
                          timeout=HTTP_TIMEOUT_S) as response:
            lines = response.iter_lines()
            streamed[index] = [next(lines), next(lines)]
            started.wait(60)
            streamed[index] += list(lines)

    def whole(index: int) -> None:
        unary[index] = httpx.post(f"{routers[index % 2].base_url}/v1/completions",
                                  json={**body, "prompt": prompts[index]}, timeout=HTTP_TIMEOUT_S)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    started.wait(60)
    # The replica with the most of them dies: its engine process, as an OOM kill would take it.
    victim = max(replicas, key=lambda r: r.metric("vllm:num_requests_running"))
    assert victim.metric("vllm:num_requests_running") > 0
    whole_threads = [threading.Thread(target=whole, args=(i,)) for i in range(len(prompts))]
    for thread in whole_threads:
        thread.start()
    engine = next(p for p in psutil.Process(victim.pid).children(recursive=True)
                  if "spawn_main" in " ".join(p.cmdline()))
    engine.send_signal(signal.SIGKILL)
    for thread in threads + whole_threads:
        thread.join(HTTP_TIMEOUT_S)
    victim.wait_exit()

    for index, lines in streamed.items():
        events = sse_events(lines)
        assert events[-1] == "[DONE]", events[-3:]
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected[index]
    assert all(response.status_code == 200 for response in unary.values()), [r.text for r in unary.values()]
    assert [response.json()["choices"][0]["text"] for response in
            (unary[i] for i in range(len(prompts)))] == expected
    resumed = sum(router.metric("kvpilot:router_resumes_total") for router in routers)
    assert resumed >= 1
