"""The fleet simulator against the real engine: one replica under the same Poisson load, side by side.

Calibrates a profile on this machine (`kvpilot simulate calibrate`'s fit), then, right after,
plays each load twice: into a real `kvpilot serve` (streaming completions of token-id prompts with
ignore_eos, sent at the trace's times; vllm:num_requests_waiting read from /metrics every
quarter second), and through the simulator (one static replica with the calibrated profile and
the same engine settings). The loads: a burst of requests sent at once, whose real throughput is
the replica's capacity, then Poisson arrivals at shares of that capacity (--levels). Reports
output throughput, median and p99 TTFT and the mean queue of each side, and their ratio.

    .venv/bin/python bench/sim_validation.py [--model DIR] [--levels 0.5,0.8,1.2] [--short]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import tempfile
import time

import httpx
import numpy as np

from kvpilot.operator.sim import calibrate, fleet, report, strategies, trace
from kvpilot.runtime.benchmarks.local_server import local_server
from kvpilot.runtime.tiny_model import make_tiny_model

SAMPLE_SECONDS = 0.25


async def _one(client: httpx.AsyncClient, prompt: list[int], output: int, start: float, delay: float
               ) -> tuple[float, float]:
    await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
    sent = time.perf_counter()
    body = {"model": "bench", "prompt": prompt, "max_tokens": output, "temperature": 0, "ignore_eos": True,
            "stream": True}
    first = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter()
    return first - sent, time.perf_counter() - start


async def _waiting(client: httpx.AsyncClient, into: list[float], stop: asyncio.Event) -> None:
    while True:  # at least one sample, however short the run
        page = (await client.get("/metrics")).text
        into.append(sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                        if line.startswith("vllm:num_requests_waiting")))
        if stop.is_set():
            return
        await asyncio.sleep(SAMPLE_SECONDS)


async def _play(base_url: str, load: trace.Trace, vocab: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, vocab, size=n).tolist() for n in load.prompt.tolist()]
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await _one(client, prompts[0][:8], 2, time.perf_counter(), 0.0)  # warm-up
        stop = asyncio.Event()
        queue: list[float] = []
        sampler = asyncio.create_task(_waiting(client, queue, stop))
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(client, p, o, start, t) for p, o, t in
                                         zip(prompts, load.output.tolist(), load.time.tolist())))
        stop.set()
        await sampler
    ttft = np.array([r[0] for r in results])
    makespan = max(r[1] for r in results)
    return _figures(float(load.output.sum()) / makespan, ttft, float(np.mean(queue)))


def _figures(throughput: float, ttft: np.ndarray, queue: float) -> dict:
    return {"output_tokens_per_s": throughput, "ttft_p50_s": float(np.median(ttft)),
            "ttft_p99_s": float(np.percentile(ttft, 99)), "mean_waiting": queue}


def _simulated(load: trace.Trace, profile, engine: fleet.Engine) -> dict:
    settings = strategies.Settings(max_replicas=1, interval_seconds=SAMPLE_SECONDS)
    loop = strategies.build("static-peak", settings, initial=1, peak=1, mean=1)
    # The queue is sampled until the last request ends, as the real side's sampler does: the
    # simulated trace lasts long enough for its intervals to reach past the drain.
    run = fleet.simulate(dataclasses.replace(load, duration=10 * load.duration + 600), loop, profile, engine)
    summary = report.summary(run, ttft_slo=1.0)
    ttft = run.first_token - load.time
    makespan = float(np.nanmax(run.finish))
    assert summary["served"] == len(load), summary
    waiting = np.asarray(run.series.waiting)[np.asarray(run.series.time) <= makespan]
    return _figures(float(load.output.sum()) / makespan, ttft, float(np.mean(waiting)))


def _burst(count: int, prompt_tokens: int, output_tokens: int, seed: int) -> trace.Trace:
    """`count` requests all sent at once: the replica's capacity, as a closed batch measures it."""
    drawn = trace.poisson(2.0 * count + 10, 1.0, prompt_tokens, output_tokens, seed)  # more than `count`
    return dataclasses.replace(drawn, time=np.zeros(count), tenant=drawn.tenant[:count], prompt=drawn.prompt[:count],
                               output=drawn.output[:count], rate=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: a 4-layer, hidden-256 tiny llama)")
    parser.add_argument("--levels", default="0.5,0.8,1.2",
                        help="Poisson loads, as shares of the capacity the real engine shows on the burst")
    parser.add_argument("--burst", type=int, default=96, help="requests in the capacity burst")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per load level")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--num-gpu-blocks", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--short", action="store_true", help="seconds, not minutes: a smoke run of both sides")
    args = parser.parse_args()
    levels = [float(level) for level in args.levels.split(",")]
    if args.short:
        levels, args.burst, args.duration, args.prompt_tokens, args.output_tokens = [0.5], 4, 2.0, 16, 8
    model_dir = args.model or str(make_tiny_model(
        tempfile.mkdtemp(prefix="kvpilot-bench-"), num_layers=4, hidden_size=256, num_heads=8,
        num_kv_heads=2, vocab_size=2048))
    load_before = os.getloadavg()
    grid = ([1, 4], [16], 4) if args.short else ([1, 4, 16, 32], [32, 128, 512], 16)
    profile = calibrate.calibrate(model_dir, batch_sizes=grid[0], context_lens=grid[1], decode_steps=grid[2],
                                  num_gpu_blocks=args.num_gpu_blocks)
    engine = fleet.Engine(args.max_num_seqs, args.max_num_batched_tokens, request_timeout_seconds=1e9,
                          startup_seconds=0.0)
    flags = ["--served-model-name", "bench", "--no-enable-prefix-caching",
             "--num-gpu-blocks-override", str(args.num_gpu_blocks), "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    with open(os.path.join(model_dir, "config.json")) as file:
        vocab = json.load(file)["vocab_size"]
    rows = []
    # Right after the calibration, in the same run, so that both see the machine alike.
    with local_server(model_dir, *flags) as base_url:
        burst = _burst(args.burst, args.prompt_tokens, args.output_tokens, args.seed)
        asyncio.run(_play(base_url, burst, vocab, args.seed + 1))  # warm-up: the first large batches are slower
        real = asyncio.run(_play(base_url, burst, vocab, args.seed))
        capacity = real["output_tokens_per_s"] / float(burst.output.mean())
        rows.append((f"{len(burst)} requests at once (capacity: {capacity:.3g}/s)", real,
                     _simulated(burst, profile, engine)))
        for level in levels:
            load = trace.poisson(level * capacity, args.duration, args.prompt_tokens, args.output_tokens,
                                 seed=args.seed)
            real = asyncio.run(_play(base_url, load, vocab, args.seed))
            rows.append((f"{level:.0%} of capacity: {len(load)} requests, Poisson {level * capacity:.3g}/s", real,
                         _simulated(load, profile, engine)))
    load_after = os.getloadavg()

    for workload, real, simulated in rows:
        for side, figures in (("the real engine", real), ("the simulator", simulated)):
            if not all(math.isfinite(value) and value >= 0 for value in figures.values()):
                raise SystemExit(f"{workload}: {side} gave no usable figures: {figures}")
    print(f"model: {model_dir}; prompts ~{args.prompt_tokens}, outputs ~{args.output_tokens} tokens;"
          f" max_num_seqs {args.max_num_seqs}; profile: {json.dumps(profile.__dict__)}")
    print(f"{os.cpu_count()} cores; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print()
    print("| workload | figure | real kvpilot serve | simulator | simulator / real |")
    print("|---|---|---|---|---|")
    for workload, real, simulated in rows:
        for key in real:
            ratio = f"{simulated[key] / real[key]:.2f}x" if real[key] else "-"
            print(f"| {workload} | {key} | {real[key]:.4g} | {simulated[key]:.4g} | {ratio} |")


if __name__ == "__main__":
    main()
