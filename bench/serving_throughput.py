"""Serving throughput over HTTP: the same requests one at a time vs all at once, side by side.

Starts `kvpilot serve` on a tiny checkpoint, then sends N streaming completions twice: sequentially,
and concurrently (continuous batching folds them into shared steps). Reports generated tokens/s
of each and their ratio.

    .venv/bin/python bench/serving_throughput.py [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

from kvpilot.runtime.benchmarks.bench_model import bench_model_dir
from kvpilot.runtime.benchmarks.local_server import local_server


async def _complete(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> int:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


async def _measure(base_url: str, prompts: list[str], max_tokens: int, concurrent: bool) -> float:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await _complete(client, prompts[0], 4)  # warm-up
        start = time.perf_counter()
        if concurrent:
            counts = await asyncio.gather(*(_complete(client, p, max_tokens) for p in prompts))
        else:
            counts = [await _complete(client, p, max_tokens) for p in prompts]
        return sum(counts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: the 4-layer, hidden-256 bench llama)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    model_dir = args.model or bench_model_dir()
    with local_server(model_dir, "--served-model-name", "bench") as base_url:
        prompts = [f"Request {i}: the morning train to the coast was late again, so" for i in range(args.num_requests)]
        sequential = asyncio.run(_measure(base_url, prompts, args.max_tokens, concurrent=False))
        concurrent = asyncio.run(_measure(base_url, prompts, args.max_tokens, concurrent=True))
    print(f"model: {model_dir}")
    print()
    print("| workload | concurrent | one at a time | speed-up |")
    print("|---|---|---|---|")
    print(f"| {args.num_requests} streaming completions x {args.max_tokens} tokens over HTTP | "
          f"{concurrent:.0f} tok/s | {sequential:.0f} tok/s | {concurrent / sequential:.2f}x |")


if __name__ == "__main__":
    main()
