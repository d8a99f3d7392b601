"""HTTP serving against the offline engine: the same streams, same engine settings, side by side.

The offline `LLM.generate` runs the requests in this process; `kvpilot serve` (a subprocess with
the same engine settings) gets them as concurrent streaming completions over HTTP. Each repetition
times one of each, interleaved, on fresh prompts (the same for both within a repetition, so that
neither side is flattered by its prefix cache). The ratio HTTP / offline of generated tokens/s says
what the API-server process, the sockets and the SSE stream cost on top of the engine.

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


def _api_process_cpu_seconds() -> float:
    """CPU time (user + system, every thread) of the `kvpilot serve` process this script started:
    the API server alone, since its EngineCore is a process of its own."""
    ticks = os.sysconf("SC_CLK_TCK")
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
        if int(fields[1]) == os.getpid() and b"kvpilot.runtime.cli" in cmdline:
            return (int(fields[11]) + int(fields[12])) / ticks
    raise RuntimeError("the server process is not a child of this one")


def _offline(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outputs), time.perf_counter() - start


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

    offline_rates, http_rates, api_cpu_per_token = [], [], []
    flags = ["--served-model-name", "bench", *args.serve_flag]
    # The server's engine process sets no thread count of its own: torch's default, as printed.
    with local_server(model_dir, *flags, env={"OMP_NUM_THREADS": str(args.threads)}) as base_url:
        warm = new_prompts()[:2]
        _offline(llm, warm, 4)
        asyncio.run(_serve_all(base_url, warm, 4))
        for _ in range(args.repetitions):
            prompts = new_prompts()
            tokens, seconds = _offline(llm, prompts, args.max_tokens)
            offline_rates.append(tokens / seconds)
            cpu_before = _api_process_cpu_seconds()
            http_tokens, seconds = asyncio.run(_serve_all(base_url, prompts, args.max_tokens))
            api_cpu_per_token.append((_api_process_cpu_seconds() - cpu_before) / http_tokens)
            if http_tokens != tokens:
                raise SystemExit(f"HTTP generated {http_tokens} tokens, offline {tokens}")
            http_rates.append(http_tokens / seconds)

    def rates(values: list[float]) -> str:
        return f"{statistics.median(values):.0f} tok/s (min {min(values):.0f})"

    ratio = statistics.median(http_rates) / statistics.median(offline_rates)
    print(f"model: {model_dir}; torch threads: {args.threads}; {args.repetitions} interleaved repetitions; "
          f"serve flags: {' '.join(args.serve_flag) or 'none'}")
    print()
    print("| workload | HTTP (median) | offline LLM (median) | HTTP / offline | API-process CPU per token |")
    print("|---|---|---|---|---|")
    print(f"| {args.num_streams} streams x {args.prompt_len}-token prompts x {args.max_tokens} tokens, greedy | "
          f"{rates(http_rates)} | {rates(offline_rates)} | {ratio:.2f}x | "
          f"{statistics.median(api_cpu_per_token) * 1e6:.0f} us |")


if __name__ == "__main__":
    main()
