"""The fleet simulator against the real engine: one replica under the same Poisson load, side by side.

Plays each load twice: into a real `kvpilot serve` (streaming completions of token-id prompts with
ignore_eos, sent at the trace's times; vllm:num_requests_waiting read from /metrics every
quarter second), and through the simulator (one static replica with a profile calibrated on this
machine by `kvpilot simulate calibrate`'s fit, the same engine settings, and the front end's own
latency, measured on the idle server with one-token requests sent one at a time, added to every
arrival). The loads: a burst of requests sent at once, whose real throughput is the replica's
capacity, then Poisson arrivals at shares of that capacity (--levels). Reports output throughput,
median and p99 TTFT and the mean queue of each side, and their ratio; and the CPU the engine, the
API server and the client took during each real load.

A shared VM's speed drifts by tens of percent within minutes, and a profile calibrated minutes
before a load would measure the drift, not the model. So every load gets its own calibration,
right before it, and the whole set of loads is played --rounds times: the report gives, for each
figure, the median over rounds of each side and of their ratio within a round, with its range.
The simulator models the engine alone, with a core of its own for each thread, as a GPU replica's
model has its device: by default the calibration and the server's EngineCore get --threads cores,
and the API server and the client the others (--no-pin leaves them free).

A request that fails ends the run with its cause (which request, when, the transport's error)
and the server's log (its path and last lines).

    .venv/bin/python bench/sim_validation.py [--model DIR] [--levels 0.5,0.8,1.2] [--duration 30] [--rounds 3] [--short]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import statistics
import time

import httpx
import numpy as np
import psutil
import torch

from kvpilot.operator.sim import calibrate, fleet, report, strategies, trace
from kvpilot.operator.sim.profile import Profile
from kvpilot.runtime.benchmarks.bench_model import bench_model_dir
from kvpilot.runtime.benchmarks.local_server import local_server

SAMPLE_SECONDS = 0.25
# The mean TTFT the API server measures (vllm:time_to_first_token_seconds, what the autoscaler's
# SLO targets read), from its arrival there: without the client's side of the front end.
SERVER_TTFT = "server_ttft_mean_s"


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


async def _server_ttft(client: httpx.AsyncClient) -> np.ndarray:
    """The API server's vllm:time_to_first_token_seconds so far: its sum and count."""
    page = (await client.get("/metrics")).text
    return np.array([sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                         if line.startswith(f"vllm:time_to_first_token_seconds_{part}")) for part in ("sum", "count")])


def _mean(before: np.ndarray, after: np.ndarray) -> float:
    total, count = after - before
    return total / count if count else math.nan


async def _waiting(client: httpx.AsyncClient, into: list[float], stop: asyncio.Event) -> None:
    while True:  # at least one sample, however short the run
        page = (await client.get("/metrics")).text
        into.append(sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                        if line.startswith("vllm:num_requests_waiting")))
        if stop.is_set():
            return
        await asyncio.sleep(SAMPLE_SECONDS)


def _server_processes() -> dict[str, list[psutil.Process]]:
    """The processes `kvpilot serve` runs as, children of this one: its API server and its EngineCore."""
    roles: dict[str, list[psutil.Process]] = {"api_server": [], "engine": []}
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            roles["api_server" if "kvpilot.runtime.cli" in child.cmdline() else "engine"].append(child)
    return roles


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus` (an affinity set on a pid binds only its main thread)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cpus)


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
        for role, processes in _server_processes().items():
            for process in processes:
                with contextlib.suppress(psutil.NoSuchProcess):
                    times = process.cpu_times()
                    seconds[role] += times.user + times.system
                    if role == "engine":
                        ran, waited = calibrate.run_queue_seconds(process.pid)
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
        server_ttft = await _server_ttft(client)
        start = time.perf_counter()
        try:
            results = await asyncio.gather(*(_one(client, i, p, o, start, t) for i, (p, o, t) in
                                             enumerate(zip(prompts, load.output.tolist(), load.time.tolist()))))
        finally:
            stop.set()
            await sampler
        cpu = machine.since(time.perf_counter() - start)
        server_ttft_mean = _mean(server_ttft, await _server_ttft(client))
    ttft = np.array([r[0] for r in results])
    makespan = max(r[1] for r in results)
    figures = _figures(float(load.output.sum()) / makespan, ttft, float(np.mean(queue)))
    return {**figures, SERVER_TTFT: server_ttft_mean}, cpu


async def _frontend_seconds(base_url: str, prompt_tokens: int, vocab: int, profile, probes: int = 16
                            ) -> tuple[float, float]:
    """What a request's first token takes beyond the engine step that computes it, on the idle
    server: one-token requests sent one at a time, less the profile's cost of the lone prefill
    step that serves each. As the client sees it (the median: the HTTP request, the ZMQ hops, the
    SSE chunk), and as the API server's TTFT histogram does (the mean: the ZMQ hops)."""
    prompts = np.random.default_rng(1).integers(1, vocab, size=(probes, prompt_tokens)).tolist()
    step = profile.step_seconds(prompt_tokens, 1, prompt_tokens)
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        before = await _server_ttft(client)
        ttfts = [(await _one(client, i, prompt, 1, time.perf_counter(), 0.0))[0] for i, prompt in enumerate(prompts)]
        server = _mean(before, await _server_ttft(client))
    return max(0.0, float(np.median(ttfts)) - step), max(0.0, server - step)


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
    return {**_figures(float(load.output.sum()) / makespan, ttft, float(np.mean(waiting))),
            "ttft_mean_s": float(np.mean(ttft))}


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
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per load level")
    parser.add_argument("--rounds", type=int, default=3, help="times the burst and every level are played")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--num-gpu-blocks", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the calibration and of the server's engine (default 1)")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="leave every process free to run on any core (by default the calibration and the"
                             " server's EngineCore get --threads cores of their own, the API server and the client"
                             " the others)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--short", action="store_true", help="seconds, not minutes: a smoke run of both sides")
    args = parser.parse_args()
    levels = [float(level) for level in args.levels.split(",")]
    if args.short:
        levels, args.burst, args.duration, args.prompt_tokens, args.output_tokens = [0.5], 4, 2.0, 16, 8
        args.rounds = 1
    model_dir = args.model or bench_model_dir()
    torch.set_num_threads(args.threads)
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin and len(cpus) <= args.threads:
        raise SystemExit(f"--threads {args.threads} leaves none of this process's {len(cpus)} cores to the API server"
                         " and the client: pass fewer threads, or --no-pin")
    engine_cpus, frontend_cpus = set(cpus[:args.threads]), set(cpus[args.threads:])
    load_before = os.getloadavg()
    grid = ([1, 4], [16], 4) if args.short else ([1, 4, 16, 32], [32, 128, 512], 16)
    engine = fleet.Engine(args.max_num_seqs, args.max_num_batched_tokens, request_timeout_seconds=1e9,
                          startup_seconds=0.0)
    flags = ["--served-model-name", "bench", "--no-enable-prefix-caching",
             "--num-gpu-blocks-override", str(args.num_gpu_blocks), "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    with open(os.path.join(model_dir, "config.json")) as file:
        vocab = json.load(file)["vocab_size"]

    def calibrated() -> tuple[Profile, Profile]:
        """A profile measured now, on the engine's cores (then this process goes back to the
        client's), with the front end as the client sees it, and as the API server does."""
        if args.pin:
            _pin(os.getpid(), engine_cpus)
        profile = calibrate.calibrate(model_dir, batch_sizes=grid[0], context_lens=grid[1], decode_steps=grid[2],
                                      num_gpu_blocks=args.num_gpu_blocks)
        if args.pin:
            _pin(os.getpid(), frontend_cpus)
        # The simulator adds the front end's latency to every arrival.
        client_side, server_side = asyncio.run(_frontend_seconds(base_url, args.prompt_tokens, vocab, profile))
        return (dataclasses.replace(profile, frontend_s=client_side),
                dataclasses.replace(profile, frontend_s=server_side))

    def played(workload: str, load: trace.Trace, seed: int) -> _Played:
        profile, server_profile = calibrated()
        try:
            real, cpu = asyncio.run(_play(base_url, load, vocab, seed))
        except RequestFailed as error:
            raise SystemExit(f"{workload}: {error}") from None
        simulated = _simulated(load, profile, engine)
        simulated[SERVER_TTFT] = _simulated(load, server_profile, engine).pop("ttft_mean_s")
        del simulated["ttft_mean_s"]
        for side, figures in (("the real engine", real), ("the simulator", simulated)):
            if not all(math.isfinite(value) and value >= 0 for value in figures.values()):
                raise SystemExit(f"{workload}: {side} gave no usable figures: {figures}")
        return _Played(real, simulated, cpu, profile)

    runs: dict[str, list[_Played]] = {}
    with local_server(model_dir, *flags, env={"OMP_NUM_THREADS": str(args.threads)}) as base_url:
        if args.pin:
            server = _server_processes()
            for process in server["engine"]:
                _pin(process.pid, engine_cpus)
            for process in server["api_server"]:
                _pin(process.pid, frontend_cpus)
        # Warm-up, as large as the burst: the first large batches are slower, and the first burst
        # sets the capacity that the levels are shares of.
        warm_up = _burst(args.burst, args.prompt_tokens, args.output_tokens, args.seed + 1)
        asyncio.run(_play(base_url, warm_up, vocab, args.seed + 1))
        capacity = None
        # The same loads in every round: the rounds differ only in what the machine does.
        seed = args.seed
        for _ in range(args.rounds):
            burst = _burst(args.burst, args.prompt_tokens, args.output_tokens, seed)
            runs.setdefault(f"{len(burst)} at once", []).append(played("burst", burst, seed))
            # The levels' rates are shares of the first round's capacity, the same in every round.
            capacity = capacity or runs[f"{len(burst)} at once"][0].real["output_tokens_per_s"] / float(
                burst.output.mean())
            for level in levels:
                load = trace.poisson(level * capacity, args.duration, args.prompt_tokens, args.output_tokens,
                                     seed=seed)
                workload = f"Poisson at {level:.0%} ({level * capacity:.3g}/s, {len(load)} requests)"
                runs.setdefault(workload, []).append(played(workload, load, seed))
    load_after = os.getloadavg()

    profiles = [run.profile for played_runs in runs.values() for run in played_runs]
    print(f"model: {model_dir}; prompts ~{args.prompt_tokens}, outputs ~{args.output_tokens} tokens;"
          f" max_num_seqs {args.max_num_seqs}; capacity {capacity:.3g} requests/s (the first burst)")
    print(f"{os.cpu_count()} cores; torch threads {args.threads} (the calibration and the server's engine);"
          f" {'pinned: the engine on cores ' + str(sorted(engine_cpus)) if args.pin else 'not pinned'};"
          f" {args.rounds} rounds; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print(f"{len(profiles)} calibrations: per-token cost {_spread([p.per_token_s * 1e3 for p in profiles])} ms,"
          f" base {_spread([p.base_s * 1e3 for p in profiles])} ms,"
          f" front end {_spread([p.frontend_s * 1e3 for p in profiles])} ms (min-max)")
    print()
    print("| workload | figure | real kvpilot serve (median) | simulator (median) | simulator / real (median)"
          " | range over rounds |")
    print("|---|---|---|---|---|---|")
    for workload, played_runs in runs.items():
        for key in played_runs[0].real:
            real = [run.real[key] for run in played_runs]
            simulated = [run.simulated[key] for run in played_runs]
            ratios = [s / r for s, r in zip(simulated, real) if r]
            ratio = (f"**{statistics.median(ratios):.2f}x** | {min(ratios):.2f}-{max(ratios):.2f}x" if ratios else "- | -")
            print(f"| {workload} | {key} | {statistics.median(real):.4g} | {statistics.median(simulated):.4g} | {ratio} |")
    print()
    print("The machine during each real load (medians over rounds): CPU seconds per wall second, and the"
          " EngineCore threads' share of a core while runnable (the calibration's steps are timed as if it"
          " were 1: their waits are taken out):")
    print()
    print("| workload | EngineCore | API server | client (this process) | EngineCore share of a core |")
    print("|---|---|---|---|---|")
    for workload, played_runs in runs.items():
        def median(key: str) -> float | None:
            values = [run.cpu[key] for run in played_runs if run.cpu[key] is not None]
            return statistics.median(values) if values else None
        print(f"| {workload} | {median('engine'):.2f} | {median('api_server'):.2f} | {median('client'):.2f}"
              f" | {_share(median('engine_share'))} |")


@dataclasses.dataclass
class _Played:
    """One load of one round: both sides' figures, the machine during the real side, and the
    profile calibrated right before it."""
    real: dict
    simulated: dict
    cpu: dict
    profile: Profile


def _spread(values: list[float]) -> str:
    return f"{min(values):.3g}-{max(values):.3g}"


def _share(share: float | None) -> str:
    return "-" if share is None else f"{share:.2f}"


if __name__ == "__main__":
    main()
