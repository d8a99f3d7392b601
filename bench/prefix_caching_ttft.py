"""Time to first token with and without prefix caching on a shared-prefix workload, over HTTP, side by side.

Two `kvpilot serve` processes on the same checkpoint, one with `--enable-prefix-caching` and one
with `--no-enable-prefix-caching`, take the same `kvpilot bench serve` runs (the shared-prefix
dataset: one common prefix, then words of each request's own; streaming completions, at most
`--max-concurrency` in flight) for several prefix lengths. The runs alternate between the two
servers. Every run draws a prefix of its own, so that no run hits blocks an earlier one cached:
what the caching server gains is the prefix shared within the run, paid for by its first request.

    .venv/bin/python bench/prefix_caching_ttft.py [--model DIR] [--output-dir DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvpilot.runtime.argtypes import positive_int
from kvpilot.runtime.benchmarks.bench_model import DESCRIPTION, bench_model_dir
from kvpilot.runtime.benchmarks.datasets import shared_prefix_dataset
from kvpilot.runtime.benchmarks.local_server import local_servers
from kvpilot.runtime.benchmarks.plot import line_figure
from kvpilot.runtime.benchmarks.report import BenchReport, best_and_median, interleaved, markdown_table
from kvpilot.runtime.benchmarks.serve import PER_REQUEST_FIELDS, ServeBenchConfig, benchmark_result

ROOT = Path(__file__).resolve().parents[1]
SERVERS = {"caching on": "--enable-prefix-caching", "caching off": "--no-enable-prefix-caching"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: the 4-layer, hidden-256 bench llama)")
    parser.add_argument("--prefix-lens", type=lambda s: [positive_int(n) for n in s.split(",")], default=[256, 1024],
                        help="words of the shared prefix, one point each")
    parser.add_argument("--num-prompts", type=positive_int, default=8)
    parser.add_argument("--input-len", type=positive_int, default=16, help="words of each request's own")
    parser.add_argument("--output-len", type=positive_int, default=4)
    parser.add_argument("--max-concurrency", type=positive_int, default=1)
    parser.add_argument("--repetitions", type=positive_int, default=3)
    parser.add_argument("--threads", type=positive_int, default=2, help="torch threads of each server")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "bench/results/prefix_caching_ttft")
    args = parser.parse_args()
    report = BenchReport(__file__, args.output_dir, args.threads, ROOT)
    model_dir = args.model or bench_model_dir()

    results: dict[str, dict] = {}
    with local_servers(model_dir, *(["--served-model-name", "bench", flag] for flag in SERVERS.values()),
                       env={"OMP_NUM_THREADS": str(args.threads)}) as base_urls:
        urls = dict(zip(SERVERS, base_urls))

        def run(name: str, prefix_len: int, point: int):
            def one(repetition: int) -> float:
                seed = 1000 * repetition + point  # a prefix of its own for every run
                config = ServeBenchConfig(base_url=urls[name], model="bench", ignore_eos=True,
                                          max_concurrency=args.max_concurrency, seed=seed)
                requests = shared_prefix_dataset(args.num_prompts, prefix_len, args.input_len, args.output_len, seed)
                result = benchmark_result(config, requests, {}, progress=False)
                assert result["failed"] == 0, result["errors"]
                results[f"{name} {prefix_len} {repetition}"] = {k: v for k, v in result.items() if k not in PER_REQUEST_FIELDS}
                return result["median_ttft_ms"]
            return one

        runs = {f"{name} {n}": run(name, n, point) for point, n in enumerate(args.prefix_lens) for name in SERVERS}
        samples = interleaved(runs, args.repetitions)

    def p99(name: str, n: int) -> list[float]:
        return [results[f"{name} {n} {r}"]["p99_ttft_ms"] for r in range(args.repetitions)]

    rows, medians = [], {name: [] for name in SERVERS}
    for n in args.prefix_lens:
        tokens = results[f"caching off {n} 0"]["total_input_tokens"] / args.num_prompts
        cells = [n, f"{tokens:.0f}"]
        for name in SERVERS:
            best, median = best_and_median(samples[f"{name} {n}"])
            medians[name].append((tokens, median))
            cells += [f"{best:.1f} / {median:.1f}", f"{best_and_median(p99(name, n))[1]:.1f}"]
        on, off = (best_and_median(samples[f"{name} {n}"])[1] for name in SERVERS)
        rows.append(cells + [f"{off / on:.2f}x"])
    table = markdown_table(["prefix words", "prompt tokens (mean)", "caching on: TTFT median ms (best / median run)",
                            "caching on: TTFT p99 ms (median run)", "caching off: TTFT median ms (best / median run)",
                            "caching off: TTFT p99 ms (median run)", "speed-up of the median TTFT"], rows)
    body = (f"Model: {model_dir if args.model else DESCRIPTION}, float32. Per run: {args.num_prompts} streaming "
            f"completions (a shared prefix, then {args.input_len} words of their own, {args.output_len} tokens out), "
            f"at most {args.max_concurrency} in flight; {args.repetitions} runs per server and prefix length, "
            f"alternating between the servers.\n\n{table}")
    figure = line_figure(
        report.output_path("ttft_prefix_caching.png"),
        {f"prefix {name}": points for name, points in medians.items()},
        xlabel="prompt tokens (shared prefix + own words)", ylabel="median TTFT, ms (median run)",
        title="TTFT with and without prefix caching", log_y=True)
    longest = args.prefix_lens[-1]
    on, off = (best_and_median(samples[f"{name} {longest}"])[1] for name in SERVERS)
    headline = (f"prefix caching cuts the median TTFT {off / on:.1f}x on a shared {longest}-word prefix "
                f"over HTTP, {off:.0f} -> {on:.0f} ms")
    report.write(body, [figure], {"median_ttft_ms": samples, "runs": results}, headline)


if __name__ == "__main__":
    main()
