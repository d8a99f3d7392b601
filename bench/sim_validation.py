"""The fleet simulator against the real engine: one replica under the same Poisson load, side by side.

Calibrates a profile on this machine (`kvpilot simulate calibrate`'s fit), then, right after,
plays each load twice: into a real `kvpilot serve` (streaming completions of token-id prompts with
ignore_eos, sent at the trace's times; vllm:num_requests_waiting read from /metrics every
quarter second), and through the simulator (one static replica with the calibrated profile and
the same engine settings, and the front end's own latency, measured on the idle server with
one-token requests sent one at a time, added to every arrival). The loads: a burst of requests sent at once, whose real throughput is
the replica's capacity, then Poisson arrivals at shares of that capacity (--levels). Reports
output throughput, median and p99 TTFT and the mean queue of each side, and their ratio; and the
CPU the engine, the API server and the client took during each real load, which the simulator
does not model: the engine gets --threads torch threads (1 by default, leaving the other cores
to the API server and the client, as a GPU replica's model has its device to itself).

A request that fails ends the run with its cause (which request, when, the transport's error)
and the server's log (its path and last lines).

    .venv/bin/python bench/sim_validation.py [--model DIR] [--levels 0.5,0.8,1.2] [--duration 60] [--short]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import time

import httpx
import numpy as np
import psutil
import torch

from kvpilot.operator.sim import calibrate, fleet, report, strategies, trace
from kvpilot.runtime.benchmarks.bench_model import bench_model_dir
from kvpilot.runtime.benchmarks.local_server import local_server

SAMPLE_SECONDS = 0.25


class RequestFailed(Exception):
    """A request of the load got no complete answer: the validation has no figures for it."""


async def _one(client: httpx.AsyncClient, index: int, prompt: list[int], output: int, start: float, delay: float
               ) -> tuple[float, float]:
    await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
    sent = time.perf_counter()
    body = {"model": "bench", "prompt": prompt, "max_tokens": output, "temperature": 0, "ignore_eos": True,
            "stream": True}
    first = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.perf_counter()
    except httpx.HTTPError as error:
        stage = "before its first token" if first is None else "while streaming"
        raise RequestFailed(f"request {index} (sent {sent - start:.2f} s into the load, {len(prompt)} prompt tokens)"
                            f" failed {stage}: {type(error).__name__}: {error or 'the server closed the connection'}"
                            ) from error
    if first is None:
        raise RequestFailed(f"request {index}: the stream ended without a token")
    return first - sent, time.perf_counter() - start


async def _waiting(client: httpx.AsyncClient, into: list[float], stop: asyncio.Event) -> None:
    while True:  # at least one sample, however short the run
        page = (await client.get("/metrics")).text
        into.append(sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                        if line.startswith("vllm:num_requests_waiting")))
        if stop.is_set():
            return
        await asyncio.sleep(SAMPLE_SECONDS)


class _Machine:
    """What the client and the server's processes took of the machine during a load: CPU seconds
    of the client (this process), the API server (`kvpilot serve`) and the EngineCore it spawned;
    and the EngineCore threads' time on a core and waiting runnable for one."""

    def __init__(self) -> None:
        self._before = self._read()

    @staticmethod
    def _read() -> tuple[dict[str, float], tuple[float, float]]:
        seconds = {"client": time.process_time(), "api_server": 0.0, "engine": 0.0}
        engine_queue = (0.0, 0.0)
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                times = child.cpu_times()
                role = "api_server" if "kvpilot.runtime.cli" in child.cmdline() else "engine"
                seconds[role] += times.user + times.system
                if role == "engine":
                    ran, waited = calibrate.run_queue_seconds(child.pid)
                    engine_queue = (engine_queue[0] + ran, engine_queue[1] + waited)
        return seconds, engine_queue

    def since(self, wall: float) -> dict:
        (cpu_before, queue_before), (cpu_after, queue_after) = self._before, self._read()
        figures = {key: (cpu_after[key] - cpu_before[key]) / wall for key in cpu_after}
        figures["engine_share"] = calibrate.cpu_share(queue_before, queue_after)
        return figures


async def _play(base_url: str, load: trace.Trace, vocab: int, seed: int) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, vocab, size=n).tolist() for n in load.prompt.tolist()]
    # No pool limit: a request waiting for a connection would count that wait in its TTFT. The
    # server's keep-alive outlasts httpx's 5 s expiry (limits.py), so no pooled connection is
    # reused as the server closes it.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        await _one(client, -1, prompts[0][:8], 2, time.perf_counter(), 0.0)  # warm-up
        stop = asyncio.Event()
        queue: list[float] = []
        sampler = asyncio.create_task(_waiting(client, queue, stop))
        machine = _Machine()
        start = time.perf_counter()
        try:
            results = await asyncio.gather(*(_one(client, i, p, o, start, t) for i, (p, o, t) in
                                             enumerate(zip(prompts, load.output.tolist(), load.time.tolist()))))
        finally:
            stop.set()
            await sampler
        cpu = machine.since(time.perf_counter() - start)
    ttft = np.array([r[0] for r in results])
    makespan = max(r[1] for r in results)
    return _figures(float(load.output.sum()) / makespan, ttft, float(np.mean(queue))), cpu


async def _frontend_seconds(base_url: str, prompt_tokens: int, vocab: int, profile, probes: int = 16) -> float:
    """What a request's first token takes beyond the engine step that computes it: the median TTFT
    of one-token requests sent one at a time to the idle server, less the profile's cost of the
    lone prefill step that serves each (the API server, the ZMQ hops, the SSE chunk)."""
    prompts = np.random.default_rng(1).integers(1, vocab, size=(probes, prompt_tokens)).tolist()
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        ttfts = [(await _one(client, i, prompt, 1, time.perf_counter(), 0.0))[0] for i, prompt in enumerate(prompts)]
    return max(0.0, float(np.median(ttfts)) - profile.step_seconds(prompt_tokens, 1, prompt_tokens))


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
    parser.add_argument("--model", help="checkpoint folder (default: the 4-layer, hidden-256 bench llama)")
    parser.add_argument("--levels", default="0.5,0.8,1.2",
                        help="Poisson loads, as shares of the capacity the real engine shows on the burst")
    parser.add_argument("--burst", type=int, default=64, help="requests in the capacity burst")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per load level")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--num-gpu-blocks", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the calibration and of the server's engine (default 1: the"
                             " model gets a core, as a GPU replica gets its device, and the API server and"
                             " the client the rest)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--short", action="store_true", help="seconds, not minutes: a smoke run of both sides")
    args = parser.parse_args()
    levels = [float(level) for level in args.levels.split(",")]
    if args.short:
        levels, args.burst, args.duration, args.prompt_tokens, args.output_tokens = [0.5], 4, 2.0, 16, 8
    model_dir = args.model or bench_model_dir()
    torch.set_num_threads(args.threads)
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

    def play(workload: str, load: trace.Trace, seed: int) -> tuple[dict, dict]:
        try:
            return asyncio.run(_play(base_url, load, vocab, seed))
        except RequestFailed as error:
            raise SystemExit(f"{workload}: {error}") from None

    def simulate(load: trace.Trace, cpu: dict) -> tuple[dict, dict | None, dict]:
        """The simulator with the profile as calibrated (a core free for each engine thread), and
        with its costs stretched by the share of a core the engine got while serving this load."""
        share = cpu["engine_share"]
        stretched = None if share is None else _simulated(load, profile.stretched(1 / share), engine)
        return _simulated(load, profile, engine), stretched, cpu

    # Right after the calibration, in the same run, so that both see the machine alike.
    with local_server(model_dir, *flags, env={"OMP_NUM_THREADS": str(args.threads)}) as base_url:
        burst = _burst(args.burst, args.prompt_tokens, args.output_tokens, args.seed)
        # Warm-up: the first large batches are slower.
        play("warm-up", _burst(min(args.burst, 16), args.prompt_tokens, args.output_tokens, args.seed + 1),
             args.seed + 1)
        # Measured before the loads, like the step costs: the simulator adds it to every arrival.
        profile = dataclasses.replace(profile, frontend_s=asyncio.run(
            _frontend_seconds(base_url, args.prompt_tokens, vocab, profile)))
        real, cpu = play("burst", burst, args.seed)
        capacity = real["output_tokens_per_s"] / float(burst.output.mean())
        rows.append((f"{len(burst)} at once (capacity {capacity:.3g}/s)", real, *simulate(burst, cpu)))
        for level in levels:
            load = trace.poisson(level * capacity, args.duration, args.prompt_tokens, args.output_tokens,
                                 seed=args.seed)
            workload = f"{level:.0%}: {len(load)} requests, Poisson {level * capacity:.3g}/s"
            real, cpu = play(workload, load, args.seed)
            rows.append((workload, real, *simulate(load, cpu)))
    load_after = os.getloadavg()

    for workload, real, simulated, _, _ in rows:
        for side, figures in (("the real engine", real), ("the simulator", simulated)):
            if not all(math.isfinite(value) and value >= 0 for value in figures.values()):
                raise SystemExit(f"{workload}: {side} gave no usable figures: {figures}")
    print(f"model: {model_dir}; prompts ~{args.prompt_tokens}, outputs ~{args.output_tokens} tokens;"
          f" max_num_seqs {args.max_num_seqs}; profile: {json.dumps(profile.__dict__)}")
    print(f"{os.cpu_count()} cores; torch threads {args.threads} (the calibration and the server's engine);"
          f" load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print()
    print("| workload | figure | real kvpilot serve | simulator | simulator / real"
          " | simulator at the serving share | / real |")
    print("|---|---|---|---|---|---|---|")
    for workload, real, simulated, stretched, _ in rows:
        for key in real:
            print(f"| {workload} | {key} | {real[key]:.4g} | {simulated[key]:.4g} | {_ratio(simulated[key], real[key])}"
                  + (f" | {stretched[key]:.4g} | {_ratio(stretched[key], real[key])} |" if stretched else " | - | - |"))
    print()
    print("The machine during each real load: CPU seconds per wall second, and the EngineCore threads'"
          " share of a core while runnable. The simulator models the engine alone; its profile's step costs"
          f" are their times with a core free (the calibration's threads got {_share(profile.cpu_share)} of one,"
          " the waits are taken out); its last column divides them by the share the engine got in the load:")
    print()
    print("| workload | EngineCore | API server | client (this process) | EngineCore share of a core |")
    print("|---|---|---|---|---|")
    for workload, *_, cpu in rows:
        print(f"| {workload} | {cpu['engine']:.2f} | {cpu['api_server']:.2f} | {cpu['client']:.2f}"
              f" | {_share(cpu['engine_share'])} |")


def _ratio(simulated: float, real: float) -> str:
    return f"{simulated / real:.2f}x" if real else "-"


def _share(share: float | None) -> str:
    return "-" if share is None else f"{share:.2f}"


if __name__ == "__main__":
    main()
