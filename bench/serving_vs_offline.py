"""HTTP serving against the offline engine: the same streams, same engine settings, side by side.

The offline `LLM.generate` runs the requests in this process; `kvpilot serve` (a subprocess with
the same engine settings) gets them as concurrent streaming completions over HTTP. Each repetition
times one of each, interleaved, on fresh prompts (the same for both within a repetition, so that
neither side is flattered by its prefix cache). The ratio HTTP / offline of generated tokens/s says
what the API-server process, the sockets and the SSE stream cost on top of the engine. Beside it,
the CPU time per generated token of each side (this process offline; the API server plus the
EngineCore process over HTTP), and their ratio: what HTTP / offline is where CPU is the limit, a
figure that a machine shared with other work disturbs less than wall-clock throughput.

The client is a bare asyncio HTTP/1.1 reader that only looks for the usage chunk and `[DONE]`, so
that on a small machine it takes as little CPU from the server as a client can; its own CPU time
per token is reported too (it shares the machine's cores with both servers' processes).

`--baseline REV` serves a second HTTP side from another revision of this repository (its runtime/
and kernels/, extracted with git archive, first on the server's PYTHONPATH), interleaved with this
tree's in every repetition: the API server's CPU per token of both, side by side under the same
load. `--threads 1,2` runs the whole comparison once per torch thread count (both engines).

    .venv/bin/python bench/serving_vs_offline.py [--baseline main] [--threads 1,2] [--model DIR]
        [--num-streams 64] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import torch

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.benchmarks.bench_model import bench_model_dir
from kvpilot.runtime.benchmarks.local_server import local_server
from kvpilot.runtime.benchmarks.revisions import baseline_env, source_tree

DONE = b"data: [DONE]"
USAGE = b'"usage":{"prompt_tokens":'


async def _stream(host: str, port: int, body: bytes) -> int:
    """One streaming completion; its completion_tokens from the usage chunk."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
    tail = b""
    try:
        while DONE not in tail:
            data = await reader.read(65536)
            if not data:
                raise RuntimeError(f"the stream ended without [DONE]: {tail[-300:]!r}")
            tail = tail[-4096:] + data
    finally:
        writer.close()
    start = tail.rindex(USAGE)
    usage = json.loads(tail[start + len(b'"usage":'):tail.index(b"}", start) + 1])
    return usage["completion_tokens"]


async def _serve_all(base_url: str, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    url = urlsplit(base_url)
    bodies = [json.dumps({"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                          "ignore_eos": True, "stream": True,
                          "stream_options": {"include_usage": True}}).encode() for prompt in prompts]
    start = time.perf_counter()
    counts = await asyncio.gather(*(_stream(url.hostname, url.port, body) for body in bodies))
    return sum(counts), time.perf_counter() - start


def _child_pid(parent: int, marker: bytes) -> int:
    """The pid of `parent`'s child whose command line holds `marker`."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        # After the name: state, then ppid.
        if int(fields[1]) == parent and marker in cmdline:
            return int(entry)
    raise RuntimeError(f"process {parent} has no child running {marker!r}")


def _cpu_seconds(pid: int) -> float:
    """CPU seconds so far of every thread of `pid`, from schedstat's nanoseconds (/proc/PID/stat
    counts 10 ms ticks: a few percent of one repetition's API-server time)."""
    total = 0
    for thread in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that ended since the listing
            with open(f"/proc/{pid}/task/{thread}/schedstat") as f:
                total += int(f.read().split()[0])
    return total / 1e9


def _server_pids(base_url: str) -> tuple[int, int]:
    """The `kvpilot serve` process this script started on `base_url`'s port (the API server) and
    its EngineCore process."""
    api_pid = _child_pid(os.getpid(), b"\0--port\0%d\0" % urlsplit(base_url).port)
    return api_pid, _child_pid(api_pid, b"spawn_main")


def _offline(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[int, float, float]:
    """Tokens generated, wall-clock seconds, CPU seconds of this process."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens, time.perf_counter() - start, time.process_time() - cpu


@dataclass
class HTTPSide:
    """One server's repetitions: tokens/s, and CPU seconds per generated token of its API server,
    its EngineCore and this script's client."""

    name: str
    base_url: str
    rates: list[float] = field(default_factory=list)
    api_cpu: list[float] = field(default_factory=list)
    engine_cpu: list[float] = field(default_factory=list)
    client_cpu: list[float] = field(default_factory=list)

    def run(self, prompts: list[list[int]], max_tokens: int, expected_tokens: int) -> None:
        api_pid, engine_pid = _server_pids(self.base_url)
        api_before, engine_before = _cpu_seconds(api_pid), _cpu_seconds(engine_pid)
        client_before = time.process_time()
        tokens, seconds = asyncio.run(_serve_all(self.base_url, prompts, max_tokens))
        client = time.process_time() - client_before
        api_after, engine_after = _cpu_seconds(api_pid), _cpu_seconds(engine_pid)
        if tokens != expected_tokens:
            raise SystemExit(f"{self.name}: HTTP generated {tokens} tokens, offline {expected_tokens}")
        self.rates.append(tokens / seconds)
        self.api_cpu.append((api_after - api_before) / tokens)
        self.engine_cpu.append((engine_after - engine_before) / tokens)
        self.client_cpu.append(client / tokens)


def _us(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e6:.0f}"


def _rates(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} tok/s (min {min(values):.0f})"


def _measure(args, model_dir: str, threads: int, baseline_pythonpath: str | None, rng: random.Random) -> None:
    torch.set_num_threads(threads)
    llm = LLM(model_dir)
    vocab = llm.config.model.vocab_size

    def new_prompts() -> list[list[int]]:
        return [[rng.randrange(5, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_streams)]

    offline_rates, offline_cpu = [], []
    flags = ["--served-model-name", "bench", *args.serve_flag]
    # The server's engine process sets no thread count of its own: OMP_NUM_THREADS sets torch's default.
    env = {"OMP_NUM_THREADS": str(threads)}
    with contextlib.ExitStack() as servers:
        sides = [HTTPSide("this tree", servers.enter_context(local_server(model_dir, *flags, env=env)))]
        if baseline_pythonpath is not None:
            sides.append(HTTPSide(f"baseline {args.baseline}", servers.enter_context(
                local_server(model_dir, *flags, env={**env, "PYTHONPATH": baseline_pythonpath}))))
        warm = new_prompts()[:2]
        _offline(llm, warm, 4)
        for side in sides:
            _server_pids(side.base_url)  # fails now, not after a timed run, if the processes are not found
            asyncio.run(_serve_all(side.base_url, warm, 4))
        for repetition in range(args.repetitions):
            prompts = new_prompts()
            tokens, seconds, cpu = _offline(llm, prompts, args.max_tokens)
            offline_rates.append(tokens / seconds)
            offline_cpu.append(cpu / tokens)
            # Alternate which server goes first, so that neither always follows the offline run.
            for side in sides[::-1] if repetition % 2 else sides:
                side.run(prompts, args.max_tokens, tokens)
    workload = f"{args.num_streams} streams x {args.prompt_len}-token prompts x {args.max_tokens} tokens, greedy"
    for side in sides:
        ratio = statistics.median(side.rates) / statistics.median(offline_rates)
        # What HTTP / offline would be where CPU time is the limit: the same work costs this much more.
        serving_cpu = statistics.median(side.api_cpu) + statistics.median(side.engine_cpu)
        cpu_ratio = f"{statistics.median(offline_cpu) / serving_cpu:.2f}x"
        print(f"| {workload}, {threads} torch thread(s) | {side.name} | {_rates(side.rates)} | {_rates(offline_rates)} | "
              f"{ratio:.2f}x | {_us(offline_cpu)} us; {_us(side.api_cpu)} + {_us(side.engine_cpu)} us | "
              f"{_us(side.client_cpu)} us | {cpu_ratio} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: the 4-layer, hidden-256 bench llama)")
    parser.add_argument("--num-streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--threads", default="1,2",
                        help="torch threads of both engines, a comma-separated list: each is its own run")
    parser.add_argument("--baseline", metavar="REV",
                        help="a git revision of this repository whose API server and engine serve a second "
                             "HTTP side, interleaved with this tree's (e.g. main)")
    parser.add_argument("--serve-flag", action="append", default=[],
                        help="an extra `kvpilot serve` flag for the HTTP side only (repeatable), e.g. --serve-flag=--stream-interval=4")
    args = parser.parse_args()
    model_dir = args.model or bench_model_dir()
    baseline_pythonpath = None if args.baseline is None else baseline_env(source_tree(args.baseline))["PYTHONPATH"]
    load = os.getloadavg()
    print(f"model: {model_dir}; {args.repetitions} interleaved repetitions; serve flags: "
          f"{' '.join(args.serve_flag) or 'none'}; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} "
          f"on {os.cpu_count()} CPUs")
    print()
    print("| workload | server | HTTP (median) | offline LLM (median) | HTTP / offline | CPU per token: offline; "
          "HTTP API server + EngineCore | bench client CPU per token | HTTP / offline by CPU |")
    print("|---|---|---|---|---|---|---|---|")
    rng = random.Random(0)
    for threads in map(int, args.threads.split(",")):
        _measure(args, model_dir, threads, baseline_pythonpath, rng)


if __name__ == "__main__":
    main()
