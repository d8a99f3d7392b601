"""What the router costs a stream: TTFT and ITL through `kvpilot router` against straight to the
replica, side by side, and the router's CPU per streamed token.

One `kvpilot serve` replica, and one router in front of it. The same `kvpilot bench serve` runs
(random prompts, greedy streaming completions, at most `--max-concurrency` in flight) alternate
between the replica's own URL and the router's. Greedy streams are the router's dearest: it reads
every event of a stream it could resume (their token ids) and writes it again without them. The
router's CPU time is read from /proc over its runs only, and divided by the tokens they streamed.

    .venv/bin/python bench/router_overhead.py [--model DIR] [--output-dir DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import psutil

from kvpilot.runtime.argtypes import positive_int
from kvpilot.runtime.benchmarks.bench_model import DESCRIPTION, bench_model_dir
from kvpilot.runtime.benchmarks.datasets import random_dataset
from kvpilot.runtime.benchmarks.local_server import local_servers
from kvpilot.runtime.benchmarks.report import BenchReport, best_and_median, interleaved, markdown_table
from kvpilot.runtime.benchmarks.serve import PER_REQUEST_FIELDS, ServeBenchConfig, benchmark_result

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("straight to the replica", "through the router")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: the 4-layer, hidden-256 bench llama)")
    parser.add_argument("--num-prompts", type=positive_int, default=64)
    parser.add_argument("--input-len", type=positive_int, default=64, help="words per prompt")
    parser.add_argument("--output-len", type=positive_int, default=64)
    parser.add_argument("--max-concurrency", type=positive_int, default=16)
    parser.add_argument("--repetitions", type=positive_int, default=3)
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads of the replica")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "bench/results/router_overhead")
    args = parser.parse_args()
    report = BenchReport(__file__, args.output_dir, args.threads, ROOT)
    model_dir = args.model or bench_model_dir()

    results: dict[str, dict] = {}
    router_cpu_s = 0.0
    with local_servers(model_dir, ["--served-model-name", "bench"], env={"OMP_NUM_THREADS": str(args.threads)}) as (replica,):
        with local_servers(model_dir, ["--backend", replica], subcommand="router") as (router,):
            urls = dict(zip(PATHS, (replica, router)))
            router_process = _process_listening_at(router)

            def run(path: str):
                def one(repetition: int) -> float:
                    nonlocal router_cpu_s
                    config = ServeBenchConfig(base_url=urls[path], model="bench", ignore_eos=True,
                                              max_concurrency=args.max_concurrency, seed=repetition)
                    requests = random_dataset(args.num_prompts, args.input_len, args.output_len, seed=repetition)
                    cpu_before = sum(router_process.cpu_times()[:2])
                    result = benchmark_result(config, requests, {}, progress=False)
                    assert result["failed"] == 0, result["errors"]
                    if path == PATHS[1]:
                        router_cpu_s += sum(router_process.cpu_times()[:2]) - cpu_before
                    results[f"{path} {repetition}"] = {k: v for k, v in result.items() if k not in PER_REQUEST_FIELDS}
                    return result["median_itl_ms"]
                return one

            interleaved({path: run(path) for path in PATHS}, args.repetitions)

    def medians(path: str, key: str) -> float:
        return best_and_median([results[f"{path} {r}"][key] for r in range(args.repetitions)])[1]

    rows = [[path, *(f"{medians(path, key):.2f}" for key in ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms",
                                                              "p99_itl_ms"))] for path in PATHS]
    streamed = sum(results[f"{PATHS[1]} {r}"]["total_output_tokens"] for r in range(args.repetitions))
    cpu_per_token_us = router_cpu_s / streamed * 1e6
    added_itl = medians(PATHS[1], "median_itl_ms") - medians(PATHS[0], "median_itl_ms")
    added_ttft = medians(PATHS[1], "median_ttft_ms") - medians(PATHS[0], "median_ttft_ms")
    table = markdown_table(["path", "TTFT median ms", "TTFT p99 ms", "ITL median ms", "ITL p99 ms"], rows)
    body = (f"Model: {model_dir if args.model else DESCRIPTION}, float32, one replica. Per run: {args.num_prompts} "
            f"greedy streaming completions ({args.input_len} words in, {args.output_len} tokens out), at most "
            f"{args.max_concurrency} in flight; {args.repetitions} runs per path, alternating; each cell is the "
            f"median over the runs.\n\n{table}\n\nThe router added {added_ttft:+.2f} ms to the median TTFT and "
            f"{added_itl:+.2f} ms to the median ITL, and spent {cpu_per_token_us:.1f} µs of CPU per streamed token "
            f"({router_cpu_s:.2f} s over {streamed} tokens).")
    headline = (f"the router adds {added_itl:+.2f} ms to the median inter-token latency at concurrency "
                f"{args.max_concurrency}, at {cpu_per_token_us:.0f} µs of CPU per streamed token")
    report.write(body, [], {"runs": results, "router_cpu_s": router_cpu_s, "streamed_tokens": streamed}, headline)


def _process_listening_at(base_url: str) -> psutil.Process:
    port = int(base_url.rsplit(":", 1)[1])
    return next(p for p in psutil.process_iter(["cmdline"])
                if p.info["cmdline"] and "router" in p.info["cmdline"] and str(port) in p.info["cmdline"])


if __name__ == "__main__":
    main()
