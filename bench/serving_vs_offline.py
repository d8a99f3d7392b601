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
that on a small machine it takes as little CPU from the server as a client can.

    .venv/bin/python bench/serving_vs_offline.py [--model DIR] [--num-streams 64] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from urllib.parse import urlsplit

import torch

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.benchmarks.local_server import local_server
from kvpilot.runtime.tiny_model import make_tiny_model

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


def _child_cpu_seconds(parent: int, marker: bytes) -> tuple[int, float]:
    """The pid and CPU time (user + system, every thread) of `parent`'s child whose command line
    holds `marker`."""
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
        # After the name: state, ppid, ... utime and stime are the 12th and 13th.
        if int(fields[1]) == parent and marker in cmdline:
            return int(entry), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    raise RuntimeError(f"process {parent} has no child running {marker!r}")


def _server_cpu_seconds() -> tuple[float, float]:
    """CPU seconds so far of the `kvpilot serve` process this script started (the API server) and
    of its EngineCore process."""
    api_pid, api = _child_cpu_seconds(os.getpid(), b"kvpilot.runtime.cli")
    _, engine = _child_cpu_seconds(api_pid, b"spawn_main")
    return api, engine


def _offline(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[int, float, float]:
    """Tokens generated, wall-clock seconds, CPU seconds of this process."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens, time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: a 4-layer, hidden-256 tiny llama)")
    parser.add_argument("--num-streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads of both engines (default: torch's own default here)")
    parser.add_argument("--serve-flag", action="append", default=[],
                        help="an extra `kvpilot serve` flag for the HTTP side only (repeatable), e.g. --serve-flag=--stream-interval=4")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model or str(make_tiny_model(
        tempfile.mkdtemp(prefix="kvpilot-bench-"), num_layers=4, hidden_size=256, num_heads=8,
        num_kv_heads=2, vocab_size=2048))
    llm = LLM(model_dir)
    vocab = llm.config.model.vocab_size
    rng = random.Random(0)

    def new_prompts() -> list[list[int]]:
        return [[rng.randrange(5, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_streams)]

    offline_rates, http_rates = [], []
    # CPU seconds per generated token: offline; the HTTP side's API server and EngineCore processes.
    offline_cpu, api_cpu, engine_cpu = [], [], []
    flags = ["--served-model-name", "bench", *args.serve_flag]
    # The server's engine process sets no thread count of its own: torch's default, as printed.
    with local_server(model_dir, *flags, env={"OMP_NUM_THREADS": str(args.threads)}) as base_url:
        warm = new_prompts()[:2]
        _server_cpu_seconds()  # fails now, not after the first timed run, if the processes are not found
        _offline(llm, warm, 4)
        asyncio.run(_serve_all(base_url, warm, 4))
        for _ in range(args.repetitions):
            prompts = new_prompts()
            tokens, seconds, cpu = _offline(llm, prompts, args.max_tokens)
            offline_rates.append(tokens / seconds)
            offline_cpu.append(cpu / tokens)
            api_before, engine_before = _server_cpu_seconds()
            http_tokens, seconds = asyncio.run(_serve_all(base_url, prompts, args.max_tokens))
            api_after, engine_after = _server_cpu_seconds()
            api_cpu.append((api_after - api_before) / http_tokens)
            engine_cpu.append((engine_after - engine_before) / http_tokens)
            if http_tokens != tokens:
                raise SystemExit(f"HTTP generated {http_tokens} tokens, offline {tokens}")
            http_rates.append(http_tokens / seconds)

    def rates(values: list[float]) -> str:
        return f"{statistics.median(values):.0f} tok/s (min {min(values):.0f})"

    ratio = statistics.median(http_rates) / statistics.median(offline_rates)
    median_us = {name: statistics.median(values) * 1e6 for name, values in
                 (("offline", offline_cpu), ("api", api_cpu), ("engine", engine_cpu))}
    # What HTTP / offline would be where CPU time is the limit: the same work costs this much more.
    cpu_ratio = median_us["offline"] / (median_us["api"] + median_us["engine"])
    print(f"model: {model_dir}; torch threads: {args.threads}; {args.repetitions} interleaved repetitions; "
          f"serve flags: {' '.join(args.serve_flag) or 'none'}")
    print()
    print("| workload | HTTP (median) | offline LLM (median) | HTTP / offline | CPU per token: offline; HTTP API "
          "server + EngineCore | HTTP / offline by CPU |")
    print("|---|---|---|---|---|---|")
    print(f"| {args.num_streams} streams x {args.prompt_len}-token prompts x {args.max_tokens} tokens, greedy | "
          f"{rates(http_rates)} | {rates(offline_rates)} | {ratio:.2f}x | {median_us['offline']:.0f} us; "
          f"{median_us['api']:.0f} + {median_us['engine']:.0f} us | {cpu_ratio:.2f}x |")


if __name__ == "__main__":
    main()
