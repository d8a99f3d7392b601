"""Decode latency when a long prompt arrives, for several chunked-prefill settings, side by side.

16 requests are decoding when one 2,000-token prompt arrives. Each setting of
`max_num_batched_tokens` / `long_prefill_token_threshold` runs the same workload on the engine core
in this process (no HTTP: what is measured is the steps themselves). The inter-token latencies of the
16 decoding requests, from the arrival until each has produced `--window` more tokens, give p50 /
p99 / max; the long prompt's time to first token and the decode tokens/s over the window show what
smaller chunks cost. Settings run interleaved, `--repetitions` times, on fresh prompts each time.

On a shared machine, wall-clock latencies measure the neighbours as much as the engine. The default
clock is therefore this thread's CPU time with one torch thread: every step runs on this thread, so
its CPU time is what the step would take on an idle core, whatever else the machine runs
(`--clock wall` measures wall-clock time instead).

    .venv/bin/python bench/chunked_prefill_latency.py [--model DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kvpilot.runtime.benchmarks.bench_model import bench_model_dir
from kvpilot.runtime.config import EngineArgs, SchedulerConfig
from kvpilot.runtime.engine.core import EngineCore
from kvpilot.runtime.request import Request, SamplingParams

# (max_num_batched_tokens, long_prefill_token_threshold); the first is the baseline of the ratios.
DEFAULT_SETTINGS = [(2048, 0), (2048, 512), (2048, 256), (1024, 0), (512, 0), (256, 0)]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _run(core: EngineCore, rng: random.Random, vocab: int, args) -> dict:
    """One arrival: the decoders' inter-token latencies after it, the long prompt's TTFT, decode tok/s."""
    def prompt(length: int) -> list[int]:
        return [rng.randrange(5, vocab) for _ in range(length)]

    decode_params = SamplingParams(max_tokens=args.warmup_tokens + args.window + 8, temperature=0, ignore_eos=True)
    decoders = [f"d{i}" for i in range(args.num_decoding)]
    for request_id in decoders:
        core.add_request(Request(request_id, prompt(args.decode_prompt_len), decode_params,
                                 max_model_len=core.config.scheduler.max_model_len))
    produced = dict.fromkeys(decoders, 0)
    while min(produced.values()) < args.warmup_tokens:
        for output in core.step():
            produced[output.request_id] += len(output.new_token_ids)

    long_params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    arrival = last = clock()
    core.add_request(Request("long", prompt(args.long_prompt_len), long_params,
                             max_model_len=core.config.scheduler.max_model_len))
    last_token = dict.fromkeys(decoders, arrival)
    after = dict.fromkeys(decoders, 0)
    latencies: list[float] = []
    long_ttft = None
    while min(after.values()) < args.window or long_ttft is None:
        outputs = core.step()
        last = clock()
        for output in outputs:
            if not output.new_token_ids:
                continue
            if output.request_id == "long":
                long_ttft = long_ttft or last - arrival
            elif after[output.request_id] < args.window:
                latencies.append(last - last_token[output.request_id])
                last_token[output.request_id] = last
                after[output.request_id] += len(output.new_token_ids)
    core.abort_requests([*decoders, "long"])
    return {"latencies": latencies, "long_ttft": long_ttft,
            "decode_rate": sum(after.values()) / (max(last_token.values()) - arrival)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: the 4-layer, hidden-256 bench llama)")
    parser.add_argument("--num-decoding", type=int, default=16)
    parser.add_argument("--decode-prompt-len", type=int, default=64)
    parser.add_argument("--long-prompt-len", type=int, default=2000)
    parser.add_argument("--warmup-tokens", type=int, default=4, help="tokens each decoder makes before the arrival")
    parser.add_argument("--window", type=int, default=32, help="tokens per decoder measured after the arrival")
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--threads", type=int, help="torch threads (default: 1 with --clock cpu, else torch's default)")
    parser.add_argument("--settings", default=",".join(f"{b}:{t}" for b, t in DEFAULT_SETTINGS),
                        help="comma-separated max_num_batched_tokens:long_prefill_token_threshold pairs")
    args = parser.parse_args()
    if args.threads is None:
        args.threads = 1 if args.clock == "cpu" else torch.get_num_threads()
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu needs --threads 1: other threads' work would not be counted")
    torch.set_num_threads(args.threads)
    settings = [tuple(int(x) for x in pair.split(":")) for pair in args.settings.split(",")]
    model_dir = args.model or bench_model_dir()

    cores = {}
    for budget, threshold in settings:
        config = EngineArgs.from_kwargs(model_dir, max_num_batched_tokens=budget,
                                        long_prefill_token_threshold=threshold,
                                        enable_prefix_caching=False,
                                        # Room for the workload, not a share of the machine's memory per engine.
                                        num_gpu_blocks_override=1024).create_engine_config()
        cores[budget, threshold] = EngineCore(config)
    vocab = next(iter(cores.values())).config.model.vocab_size
    rng = random.Random(0)
    results: dict[tuple[int, int], list[dict]] = {setting: [] for setting in settings}
    for core in cores.values():
        _run(core, rng, vocab, argparse.Namespace(**{**vars(args), "window": 2, "long_prompt_len": 64}))  # warm-up
    for repetition in range(args.repetitions):
        order = settings if repetition % 2 == 0 else settings[::-1]
        for setting in order:
            results[setting].append(_run(cores[setting], rng, vocab, args))

    def summary(setting) -> dict:
        runs = results[setting]
        p99 = [_percentile(r["latencies"], 0.99) for r in runs]
        return {"p50": statistics.median(_percentile(r["latencies"], 0.5) for r in runs),
                "p99": statistics.median(p99), "p99_min": min(p99),
                "max": statistics.median(max(r["latencies"]) for r in runs),
                "ttft": statistics.median(r["long_ttft"] for r in runs),
                "rate": statistics.median(r["decode_rate"] for r in runs)}

    summaries = {setting: summary(setting) for setting in settings}
    baseline = summaries[settings[0]]
    defaults = SchedulerConfig()
    print(f"model: {model_dir}; torch threads: {args.threads}; clock: {args.clock}; "
          f"{args.repetitions} interleaved repetitions; "
          f"kvpilot's defaults: max_num_batched_tokens {defaults.max_num_batched_tokens}, "
          f"long_prefill_token_threshold {defaults.long_prefill_token_threshold}")
    print()
    print("| workload | max_num_batched_tokens | long_prefill_token_threshold | decode ITL p50 | p99 (min) | max | "
          "long prompt TTFT | decode tok/s | p99 vs first row |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (budget, threshold), s in summaries.items():
        print(f"| {args.num_decoding} decoding + one {args.long_prompt_len}-token arrival | {budget} | {threshold} | "
              f"{s['p50'] * 1e3:.0f} ms | {s['p99'] * 1e3:.0f} ms ({s['p99_min'] * 1e3:.0f}) | {s['max'] * 1e3:.0f} ms | "
              f"{s['ttft']:.2f} s | {s['rate']:.0f} | {s['p99'] / baseline['p99']:.2f}x |")


if __name__ == "__main__":
    main()
