"""Inter-token latency of running streams when a long prompt arrives, with and without chunked
prefill, over HTTP, side by side.

One `kvpilot serve` per chunk cap (`--long-prefill-token-threshold`; 0 means no cap, so the
whole prompt is prefilled in one step, which is what running without chunked prefill means
here), with the same `--max-num-batched-tokens`. In each round, `--num-streams` streaming
completions start together; once every one of them has its first token, one long prompt
arrives. Reported: the streams' inter-token latency (median, p99, max) and the long prompt's
time to first token. Rounds alternate between the servers, every round draws prompts of its
own, and prefix caching is off on both, so no round reuses another's KV.

    .venv/bin/python bench/chunked_prefill_itl.py [--model DIR] [--output-dir DIR] [--thresholds 0,512]
"""

from __future__ import annotations

import argparse
import asyncio
import random
from pathlib import Path

from kvpilot.runtime.argtypes import positive_int
from kvpilot.runtime.benchmarks.bench_model import DESCRIPTION, bench_model_dir
from kvpilot.runtime.benchmarks.datasets import BenchRequest, random_words, warmup_requests
from kvpilot.runtime.benchmarks.local_server import local_servers
from kvpilot.runtime.benchmarks.plot import scatter_figure
from kvpilot.runtime.benchmarks.report import BenchReport, best_and_median, interleaved, markdown_table
from kvpilot.runtime.benchmarks.results import summarize
from kvpilot.runtime.benchmarks.serve import ServeBenchConfig, check_server, client_for, send_request

ROOT = Path(__file__).resolve().parents[1]


def _label(threshold: int) -> str:
    return "one step (no chunking)" if threshold == 0 else f"chunks of {threshold}"


async def _round(base_url: str, streams: list[BenchRequest], long: BenchRequest) -> dict:
    config = ServeBenchConfig(base_url=base_url, model="bench", ignore_eos=True)
    async with client_for(config, max_connections=len(streams) + 2) as client:
        await check_server(client, config)
        await send_request(client, config, warmup_requests(1)[0])
        firsts = [asyncio.Event() for _ in streams]
        tasks = [asyncio.create_task(send_request(client, config, r, first)) for r, first in zip(streams, firsts)]
        await asyncio.gather(*(first.wait() for first in firsts))
        long_result = await send_request(client, config, long)
        results = await asyncio.gather(*tasks)
    failed = [r.error for r in [*results, long_result] if not r.success]
    assert not failed, failed
    arrival = long_result.sent_at
    gaps = []  # (seconds since the long prompt was sent, gap in ms) of every stream's tokens
    for r in results:
        at = r.sent_at + r.ttft
        for gap in r.itl:
            at += gap
            gaps.append((at - arrival, gap * 1000))
    summary = summarize(results, duration=max(r.sent_at + r.e2e_latency for r in results) - arrival)
    return {"median_itl_ms": summary["median_itl_ms"], "p99_itl_ms": summary["p99_itl_ms"],
            "max_itl_ms": max(g for _, g in gaps), "long_ttft_ms": long_result.ttft * 1000,
            "long_prompt_tokens": long_result.prompt_tokens, "gaps": gaps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: the 4-layer, hidden-256 bench llama)")
    parser.add_argument("--thresholds", type=lambda s: [int(t) for t in s.split(",")], default=[0, 512],
                        help="--long-prefill-token-threshold of each server (0: the whole prompt in one step)")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    parser.add_argument("--num-streams", type=positive_int, default=16)
    parser.add_argument("--stream-input-len", type=positive_int, default=32, help="words per stream prompt")
    parser.add_argument("--stream-output-len", type=positive_int, default=64)
    parser.add_argument("--long-input-len", type=positive_int, default=1000, help="words of the long prompt")
    parser.add_argument("--repetitions", type=positive_int, default=3)
    parser.add_argument("--threads", type=positive_int, default=2, help="torch threads of each server")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "bench/results/chunked_prefill_itl")
    args = parser.parse_args()
    report = BenchReport(__file__, args.output_dir, args.threads, ROOT)
    model_dir = args.model or bench_model_dir()

    rounds: dict[str, list[dict]] = {_label(t): [] for t in args.thresholds}
    flag_sets = [["--served-model-name", "bench", "--no-enable-prefix-caching", "--max-num-batched-tokens",
                  str(args.max_num_batched_tokens), "--long-prefill-token-threshold", str(t)] for t in args.thresholds]
    with local_servers(model_dir, *flag_sets, env={"OMP_NUM_THREADS": str(args.threads)}) as base_urls:
        urls = dict(zip(map(_label, args.thresholds), base_urls))

        def run(name: str):
            def one(repetition: int) -> float:
                rng = random.Random(f"{name} {repetition}")
                streams = [BenchRequest(random_words(rng, args.stream_input_len), args.stream_output_len)
                           for _ in range(args.num_streams)]
                outcome = asyncio.run(_round(urls[name], streams, BenchRequest(random_words(rng, args.long_input_len), 16)))
                rounds[name].append(outcome)
                return outcome["p99_itl_ms"]
            return one

        interleaved({name: run(name) for name in urls}, args.repetitions)

    def stat(name: str, key: str) -> tuple[float, float]:
        return best_and_median([r[key] for r in rounds[name]])

    rows = []
    for name in rounds:
        rows.append([name, *(f"{stat(name, key)[0]:.0f} / {stat(name, key)[1]:.0f}"
                             for key in ("median_itl_ms", "p99_itl_ms", "max_itl_ms", "long_ttft_ms"))])
    table = markdown_table(["prefill of the long prompt", "streams' ITL median ms", "ITL p99 ms", "ITL max ms",
                            "long prompt's TTFT ms"], rows)
    tokens = rounds[next(iter(rounds))][0]["long_prompt_tokens"]
    body = (f"Model: {model_dir if args.model else DESCRIPTION}, float32, `--max-num-batched-tokens "
            f"{args.max_num_batched_tokens}`, prefix caching off. Per round: {args.num_streams} streams "
            f"({args.stream_input_len} words in, {args.stream_output_len} tokens out), then one prompt of "
            f"{tokens} tokens (16 out) once every stream has its first token; {args.repetitions} rounds per "
            f"server, alternating. Each cell: best / median over the rounds.\n\n{table}")
    # The median round's gaps of each server (by its p99), in time since the long prompt arrived.
    median_rounds = {name: sorted(rs, key=lambda r: r["p99_itl_ms"])[len(rs) // 2] for name, rs in rounds.items()}
    figure = scatter_figure(
        report.output_path("itl_long_prompt.png"), {name: r["gaps"] for name, r in median_rounds.items()},
        xlabel="seconds since the long prompt arrived", ylabel="gap between tokens of a stream, ms",
        title=f"Streams' ITL when a {tokens}-token prompt arrives (median round)", log_y=True)
    base, last = list(rounds)[0], list(rounds)[-1]
    (base_itl, last_itl), (base_ttft, last_ttft) = ((stat(base, k)[1], stat(last, k)[1]) for k in ("p99_itl_ms", "long_ttft_ms"))
    headline = (f"{last} against {base}: the p99 inter-token latency of {args.num_streams} running streams when a "
                f"{tokens}-token prompt arrives {base_itl:.0f} -> {last_itl:.0f} ms ({last_itl / base_itl:.2f}x), the long "
                f"prompt's TTFT {base_ttft:.0f} -> {last_ttft:.0f} ms ({last_ttft / base_ttft:.2f}x; medians)")
    data = {name: [{k: v for k, v in r.items() if k != "gaps"} for r in rs] for name, rs in rounds.items()}
    report.write(body, [figure], {"rounds": data}, headline)


if __name__ == "__main__":
    main()
