"""`kvpilot serve --tensor-parallel-size 2` under concurrent load with aborts stays token-exact.

Aborts reach the ranks as finished ids in the middle of a batch: the same messages whose order
once differed between ranks (see tests/runtime/engine/test_tp_stress.py).
"""

from __future__ import annotations

import asyncio
import os
import random
from concurrent.futures import ThreadPoolExecutor

import httpx

from server_harness import HTTP_TIMEOUT_S, start_server

MAX_TOKENS = 24


def test_served_tensor_parallel_is_exact_under_concurrent_load_and_aborts(tiny_qwen2_dir, tmp_path):
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 512) for _ in range(n)] for n in (3, 8, 17, 31, 64, 100, 9, 45)]
    # No PYTHONHASHSEED: every spawned rank picks its own at random.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONHASHSEED"}
    # The two start together, their start-ups overlapping; the reference (one process, a pool with
    # room for everything, the same detokenizing path) then answers before the TP server's load.
    with ThreadPoolExecutor(2) as pool:
        starts = [pool.submit(start_server, tiny_qwen2_dir, tmp_path),
                  pool.submit(start_server, tiny_qwen2_dir, tmp_path, "--tensor-parallel-size", "2",
                              "--block-size", "8", "--max-num-batched-tokens", "24", "--max-num-seqs", "4",
                              "--num-gpu-blocks-override", "30", env=env)]
    started = [start.result() for start in starts if start.exception() is None]
    try:
        single, server = (start.result() for start in starts)
        expected = asyncio.run(_complete_all(single.base_url, prompts, abandon=False))
        single.stop()
        for _ in range(3):
            assert asyncio.run(_complete_all(server.base_url, prompts, abandon=True)) == expected
        assert server.metric("vllm:num_preemptions_total") > 0
    finally:
        for process in started:
            process.stop()


async def _complete_all(base_url: str, prompts: list[list[int]], abandon: bool) -> list[str]:
    """Every prompt's greedy completion; with `abandon`, four more streams are dropped mid-way."""
    async with httpx.AsyncClient(base_url=base_url, timeout=HTTP_TIMEOUT_S) as client:

        async def complete(prompt: list[int]) -> str:
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        async def walk_away(prompt: list[int]) -> None:
            body = {"prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break

        walkers = [walk_away(prompt[:5] + [7]) for prompt in prompts[:4]] if abandon else []
        results = await asyncio.gather(*(complete(prompt) for prompt in prompts), *walkers)
        return results[: len(prompts)]
