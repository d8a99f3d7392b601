"""TTFT on multi-turn conversations through `kvpilot router`: prefix-aware against round-robin,
side by side, in front of the same three replicas.

Three `kvpilot serve` replicas publish their KV-cache events; two routers (one prefix-aware, one
round-robin) watch the same replicas. The same multi-turn workload (each turn's prompt the whole
conversation so far, greedy streamed chat completions, a few conversations at a time) alternates
between the routers, every run with a cache salt of its own, so that no run hits blocks another
cached. The table has TTFT over every turn, and the prefix-cache hits the replicas' own counters
report for the run (vllm:prefix_cache_hits_total).

    .venv/bin/python bench/router_prefix_ttft.py [--model DIR] [--output-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.runtime.argtypes import positive_int
from kvpilot.runtime.benchmarks.bench_model import DESCRIPTION, bench_model_dir
from kvpilot.runtime.benchmarks.conversations import conversation_questions, run_conversations
from kvpilot.runtime.benchmarks.local_server import _free_port, local_servers
from kvpilot.runtime.benchmarks.plot import line_figure
from kvpilot.runtime.benchmarks.report import BenchReport, best_and_median, interleaved, markdown_table
from kvpilot.runtime.benchmarks.results import latency_summary

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ("prefix-aware", "round-robin")
REPLICAS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: the 4-layer, hidden-256 bench llama)")
    parser.add_argument("--conversations", type=positive_int, default=12)
    parser.add_argument("--turns", type=positive_int, default=4)
    parser.add_argument("--words-first-turn", type=positive_int, default=900,
                        help="words of each conversation's first message (a document to talk about)")
    parser.add_argument("--words-per-turn", type=positive_int, default=24, help="words of each later message")
    parser.add_argument("--output-len", type=positive_int, default=16)
    parser.add_argument("--max-concurrency", type=positive_int, default=3, help="conversations at a time")
    parser.add_argument("--repetitions", type=positive_int, default=3)
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads of each replica")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "bench/results/router_prefix_ttft")
    args = parser.parse_args()
    report = BenchReport(__file__, args.output_dir, args.threads, ROOT)
    model_dir = args.model or bench_model_dir()

    replica_flags = [["--served-model-name", "bench", "--kv-events-config", _kv_events_config()]
                     for _ in range(REPLICAS)]
    runs: dict[str, dict] = {}
    with local_servers(model_dir, *replica_flags, env={"OMP_NUM_THREADS": str(args.threads)}) as replicas:
        backends = [arg for url in replicas for arg in ("--backend", url)]
        with local_servers(model_dir, *([*backends, "--routing-strategy", s] for s in STRATEGIES),
                           subcommand="router") as routers:
            router_of = dict(zip(STRATEGIES, routers))

            def run(strategy: str):
                def one(repetition: int) -> float:
                    questions = conversation_questions(args.conversations, args.turns, args.words_per_turn,
                                                       seed=repetition, words_first_turn=args.words_first_turn)
                    hits = _fleet_hits(replicas)
                    turns = asyncio.run(run_conversations(
                        [router_of[strategy]], questions, model="bench", max_tokens=args.output_len,
                        concurrency=args.max_concurrency, cache_salt=f"{strategy} {repetition}"))
                    ttfts = [t.ttft_s for conversation in turns for t in conversation]
                    by_turn = [statistics.median(c[turn].ttft_s * 1000 for c in turns) for turn in range(args.turns)]
                    runs[f"{strategy} {repetition}"] = {**latency_summary(ttfts, "ttft", (99,)),
                                                        "median_ttft_ms_by_turn": by_turn,
                                                        "prefix_cache_hit_tokens": _fleet_hits(replicas) - hits}
                    return runs[f"{strategy} {repetition}"]["median_ttft_ms"]
                return one

            samples = interleaved({s: run(s) for s in STRATEGIES}, args.repetitions)

    def median_of(strategy: str, key: str) -> float:
        return best_and_median([runs[f"{strategy} {r}"][key] for r in range(args.repetitions)])[1]

    rows = [[s, f"{median_of(s, 'median_ttft_ms'):.1f}", f"{median_of(s, 'p99_ttft_ms'):.1f}",
             f"{median_of(s, 'prefix_cache_hit_tokens'):.0f}"] for s in STRATEGIES]
    ratio = median_of("prefix-aware", "median_ttft_ms") / median_of("round-robin", "median_ttft_ms")
    table = markdown_table(["routing", "TTFT median ms", "TTFT p99 ms", "prefix-cache hits (tokens, all replicas)"], rows)
    body = (f"Model: {model_dir if args.model else DESCRIPTION}, float32, {REPLICAS} replicas. Per run: "
            f"{args.conversations} conversations of {args.turns} turns (a first message of {args.words_first_turn} "
            f"words, then {args.words_per_turn} words a turn; {args.output_len} tokens out, greedy, streamed), "
            f"{args.max_concurrency} conversations at a time; "
            f"{args.repetitions} runs per routing, alternating; each cell is the median over the runs.\n\n{table}\n\n"
            f"Prefix-aware's median TTFT is {ratio:.2f} of round-robin's.")
    figure = line_figure(
        report.output_path("ttft_by_turn.png"),
        {s: [(turn + 1, statistics.median(runs[f"{s} {r}"]["median_ttft_ms_by_turn"][turn]
                                          for r in range(args.repetitions))) for turn in range(args.turns)]
         for s in STRATEGIES},
        xlabel="turn of the conversation", ylabel="median TTFT, ms (median run)",
        title=f"TTFT by turn over {REPLICAS} replicas", log_y=True)
    headline = f"prefix-aware routing over {REPLICAS} replicas: {ratio:.2f}x round-robin's median TTFT on multi-turn chats"
    report.write(body, [figure], {"median_ttft_ms": samples, "runs": runs}, headline)


def _kv_events_config() -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"tcp://127.0.0.1:{_free_port()}", "replay_endpoint": f"tcp://127.0.0.1:{_free_port()}"})


def _fleet_hits(replicas: list[str]) -> float:
    total = 0.0
    for url in replicas:
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
            total += sum(s.value for s in family.samples if s.name == "vllm:prefix_cache_hits_total")
    return total


if __name__ == "__main__":
    main()
