"""What the router costs a stream: TTFT and ITL through `kvpilot router` against straight to the
replica, side by side, and the router's CPU per streamed token.

One `kvpilot serve` replica, and one router in front of it. The same `kvpilot bench serve` runs
(random prompts, greedy streaming completions, at most `--max-concurrency` in flight) alternate
between the replica's own URL and the router's, after a run through each that is not counted. Greedy streams are the router's dearest: it reads
every event of a stream it could resume (their token ids) and writes it again without them. The
router's CPU time is read from /proc over its runs only, and divided by the tokens they streamed.
It is then split three ways: what the router spends idle, per second (its polls of the replica), read
over a quiet window before the runs; and, from as many more runs with longer outputs, a cost per
streamed token and one per request.

    .venv/bin/python bench/router_overhead.py [--model DIR] [--output-dir DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import psutil

from kvpilot.runtime.argtypes import positive_float, positive_int
from kvpilot.runtime.benchmarks.bench_model import DESCRIPTION, bench_model_dir
from kvpilot.runtime.benchmarks.datasets import random_dataset
from kvpilot.runtime.benchmarks.local_server import local_servers
from kvpilot.runtime.benchmarks.plot import line_figure
from kvpilot.runtime.benchmarks.report import BenchReport, best_and_median, interleaved, markdown_table
from kvpilot.runtime.benchmarks.serve import PER_REQUEST_FIELDS, ServeBenchConfig, benchmark_result

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("straight to the replica", "through the router")
PERCENTILES = (10, 25, 50, 75, 90, 95, 99)
LONG_OUTPUT_FACTOR = 4
# Long enough for the router's idle CPU to span several of /proc's 10 ms ticks.
IDLE_WINDOW_S = 10.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: the 4-layer, hidden-256 bench llama)")
    parser.add_argument("--num-prompts", type=positive_int, default=64)
    parser.add_argument("--input-len", type=positive_int, default=64, help="words per prompt")
    parser.add_argument("--output-len", type=positive_int, default=128)
    parser.add_argument("--max-concurrency", type=positive_int, default=16)
    parser.add_argument("--repetitions", type=positive_int, default=3)
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads of the replica")
    parser.add_argument("--idle-window", type=positive_float, default=IDLE_WINDOW_S,
                        help="seconds over which the router's idle CPU is read")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "bench/results/router_overhead")
    args = parser.parse_args()
    report = BenchReport(__file__, args.output_dir, args.threads, ROOT)
    model_dir = args.model or bench_model_dir()

    results: dict[str, dict] = {}
    # Every token gap each path's clients saw, over all its runs (seconds).
    gaps: dict[str, list[float]] = {path: [] for path in PATHS}
    router_cpu_s = router_busy_s = 0.0
    with local_servers(model_dir, ["--served-model-name", "bench"], env={"OMP_NUM_THREADS": str(args.threads)}) as (replica,):
        with local_servers(model_dir, ["--backend", replica], subcommand="router") as (router,):
            urls = dict(zip(PATHS, (replica, router)))
            router_process = _process_listening_at(router)

            def run(path: str):
                def one(repetition: int) -> float:
                    nonlocal router_cpu_s, router_busy_s
                    config = ServeBenchConfig(base_url=urls[path], model="bench", ignore_eos=True,
                                              max_concurrency=args.max_concurrency, seed=repetition)
                    requests = random_dataset(args.num_prompts, args.input_len, args.output_len, seed=repetition)
                    cpu_before = _cpu_s(router_process)
                    result = benchmark_result(config, requests, {}, progress=False)
                    assert result["failed"] == 0, result["errors"]
                    if path == PATHS[1]:
                        router_cpu_s += _cpu_s(router_process) - cpu_before
                        router_busy_s += result["duration"]
                    results[f"{path} {repetition}"] = {k: v for k, v in result.items() if k not in PER_REQUEST_FIELDS}
                    gaps[path] += [gap for request in result["itls"] for gap in request]
                    return result["median_itl_ms"]
                return one

            # A first run through each path, not counted: connections, caches and allocators warm up.
            for url in urls.values():
                warm_up = ServeBenchConfig(base_url=url, model="bench", ignore_eos=True,
                                           max_concurrency=args.max_concurrency, seed=-1)
                benchmark_result(warm_up, random_dataset(args.num_prompts, args.input_len, args.output_len, seed=-1),
                                 {}, progress=False)
            cpu_before = _cpu_s(router_process)
            time.sleep(args.idle_window)
            idle_cpu_per_s = (_cpu_s(router_process) - cpu_before) / args.idle_window
            interleaved({path: run(path) for path in PATHS}, args.repetitions)
            # The same requests through the router with outputs LONG_OUTPUT_FACTOR times longer: the
            # difference is what a streamed token costs it, apart from each request's own work
            # (parsing, tokenizing, hashing, picking, connecting).
            long_cpu_s = long_busy_s = long_tokens = 0
            for repetition in range(args.repetitions):
                long_config = ServeBenchConfig(base_url=router, model="bench", ignore_eos=True,
                                               max_concurrency=args.max_concurrency, seed=repetition)
                requests = random_dataset(args.num_prompts, args.input_len, args.output_len * LONG_OUTPUT_FACTOR,
                                          seed=repetition)
                cpu_before = _cpu_s(router_process)
                long_run = benchmark_result(long_config, requests, {}, progress=False)
                long_cpu_s += _cpu_s(router_process) - cpu_before
                long_busy_s += long_run["duration"]
                long_tokens += long_run["total_output_tokens"]

    def medians(path: str, key: str) -> float:
        return best_and_median([results[f"{path} {r}"][key] for r in range(args.repetitions)])[1]

    rows = [[path, *(f"{medians(path, key):.2f}" for key in ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms",
                                                              "p99_itl_ms"))] for path in PATHS]
    streamed = sum(results[f"{PATHS[1]} {r}"]["total_output_tokens"] for r in range(args.repetitions))
    cpu_per_token_us = router_cpu_s / streamed * 1e6
    # The runs' CPU less what the router spends idle over as long: what their requests cost.
    short_cpu_s = (router_cpu_s - idle_cpu_per_s * router_busy_s) / args.repetitions
    short_tokens = streamed / args.repetitions
    long_work_s = (long_cpu_s - idle_cpu_per_s * long_busy_s) / args.repetitions
    marginal_us = (long_work_s - short_cpu_s) / (long_tokens / args.repetitions - short_tokens) * 1e6
    per_request_ms = (short_cpu_s - marginal_us * 1e-6 * short_tokens) / args.num_prompts * 1e3
    added_itl = medians(PATHS[1], "median_itl_ms") - medians(PATHS[0], "median_itl_ms")
    added_ttft = medians(PATHS[1], "median_ttft_ms") - medians(PATHS[0], "median_ttft_ms")
    table = markdown_table(["path", "TTFT median ms", "TTFT p99 ms", "ITL median ms", "ITL p99 ms"], rows)
    body = (f"Model: {model_dir if args.model else DESCRIPTION}, float32, one replica. Per run: {args.num_prompts} "
            f"greedy streaming completions ({args.input_len} words in, {args.output_len} tokens out), at most "
            f"{args.max_concurrency} in flight; {args.repetitions} runs per path, alternating; each cell is the "
            f"median over the runs.\n\n{table}\n\nThe router added {added_ttft:+.2f} ms to the median TTFT and "
            f"{added_itl:+.2f} ms to the median ITL, and spent {cpu_per_token_us:.1f} µs of CPU per streamed token "
            f"({router_cpu_s:.2f} s over {streamed} tokens). Apart, from {args.repetitions} more runs with outputs "
            f"{LONG_OUTPUT_FACTOR}x longer ({long_cpu_s:.2f} s over {long_tokens} tokens), less what the router "
            f"spends idle ({idle_cpu_per_s * 1e3:.1f} ms a second, polling its replica's /health and /metrics, read "
            f"over {args.idle_window:g} s before the runs): {marginal_us:.1f} µs per streamed token, and "
            f"{per_request_ms:.2f} ms per request. CPU time is read in 10 ms ticks.")
    figure = line_figure(
        report.output_path("itl_percentiles.png"),
        {path: [(p, _percentile(sorted(gaps[path]), p) * 1000) for p in PERCENTILES] for path in PATHS},
        xlabel="percentile of the inter-token gaps", ylabel="inter-token latency, ms",
        title=f"ITL at concurrency {args.max_concurrency}, with and without the router", log_y=True)
    headline = (f"the router adds {added_itl:+.2f} ms to the median inter-token latency at concurrency "
                f"{args.max_concurrency}; its CPU: {marginal_us:.0f} µs per streamed token, {per_request_ms:.1f} ms "
                f"per request, {idle_cpu_per_s * 1e3:.1f} ms a second idle")
    report.write(body, [figure], {"runs": results, "router_cpu_s": router_cpu_s, "streamed_tokens": streamed,
                                  "long_runs_cpu_s": long_cpu_s, "long_runs_tokens": long_tokens,
                                  "idle_cpu_s_per_s": idle_cpu_per_s},
                 headline)


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _percentile(ordered: list[float], p: float) -> float:
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def _process_listening_at(base_url: str) -> psutil.Process:
    port = int(base_url.rsplit(":", 1)[1])
    return next(p for p in psutil.process_iter(["cmdline"])
                if p.info["cmdline"] and "router" in p.info["cmdline"] and str(port) in p.info["cmdline"])


if __name__ == "__main__":
    main()
