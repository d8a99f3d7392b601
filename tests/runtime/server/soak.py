"""A soak: many streaming requests at once, random in length, n and stop strings, a fifth of them
dropped by their clients at a random point; afterwards nothing may be left behind.

`make soak` runs 2,000 requests at concurrency 64 on a fresh server and prints the figures (the
README's Reliability section quotes them); test_soak.py runs 300 in `make test`. What must hold:
- every request that was not dropped has the right `usage` (its prompt's token count, and as
  many completion tokens as its choices streamed, counted through per-token logprobs);
- the engine is idle and empty: nothing running or waiting, every KV block free (usage 0, which
  the block pool reports only when every block but the null one is back in its free queue);
- the API server's and the engine's RSS are within 10 % of their values after a warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from server_harness import HTTP_TIMEOUT_S, ServerProcess, engine_core_pid, sse_events, start_server, wait_until

WORDS = "the a river stone light under over quiet market engine cloud paper silver north".split()
RSS_TOLERANCE = 0.10


@dataclass
class SoakReport:
    requests: int = 0
    dropped: int = 0
    completed: int = 0
    usage_errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    # (after warm-up, after the soak), in MiB.
    server_rss: tuple[float, float] = (0.0, 0.0)
    engine_rss: tuple[float, float] = (0.0, 0.0)

    def rss_growth(self) -> float:
        return max(after / before - 1 for before, after in (self.server_rss, self.engine_rss))

    def lines(self) -> list[str]:
        return [
            f"requests: {self.requests} ({self.dropped} dropped by their clients, {self.completed} completed) "
            f"in {self.seconds:.0f} s",
            f"usage errors: {len(self.usage_errors)}",
            f"API server RSS: {self.server_rss[0]:.0f} -> {self.server_rss[1]:.0f} MiB; "
            f"engine RSS: {self.engine_rss[0]:.0f} -> {self.engine_rss[1]:.0f} MiB "
            f"(largest growth {100 * self.rss_growth():+.1f} %)",
        ]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


async def _one(client: httpx.AsyncClient, rng: random.Random, prompt_tokens: dict[str, int],
               report: SoakReport) -> None:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    body = {"prompt": prompt, "max_tokens": rng.randint(1, 16), "n": rng.choice([1, 1, 1, 2, 3]),
            "temperature": rng.choice([0, 0.8]), "seed": rng.randrange(1000), "logprobs": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if rng.random() < 0.3:
        body["stop"] = rng.sample(WORDS, rng.randint(1, 3))
    drop_after = rng.randint(0, 6) if rng.random() < 0.2 else None
    report.requests += 1
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            report.usage_errors.append(f"{response.status_code} for {body}")
            return
        lines = []
        async for line in response.aiter_lines():
            lines.append(line)
            if drop_after is not None and len(lines) > drop_after:
                report.dropped += 1
                return  # leaving the block closes the connection mid-stream
    events = sse_events(lines)
    if events[-1] != "[DONE]":
        report.usage_errors.append(f"no [DONE]: {events[-1]}")
        return
    report.completed += 1
    streamed = sum(len(choice["logprobs"]["tokens"]) for event in events[:-2] for choice in event["choices"])
    usage = events[-2]["usage"]
    if prompt not in prompt_tokens:
        tokenized = await client.post("/tokenize", json={"prompt": prompt})
        prompt_tokens[prompt] = tokenized.json()["count"]
    expected = {"prompt_tokens": prompt_tokens[prompt], "completion_tokens": streamed,
                "total_tokens": prompt_tokens[prompt] + streamed}
    if usage != expected:
        report.usage_errors.append(f"usage {usage} != {expected} for {body}")


async def _load(base_url: str, num_requests: int, concurrency: int, seed: int, report: SoakReport) -> None:
    rng = random.Random(seed)
    prompt_tokens: dict[str, int] = {}
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=HTTP_TIMEOUT_S, limits=limits) as client:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for index in range(num_requests):
            queue.put_nowait(index)

        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                await _one(client, rng, prompt_tokens, report)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def engine_is_empty(server: ServerProcess) -> bool:
    samples = server.metrics()
    return all(sum(v for (name, _), v in samples.items() if name == metric) == 0 for metric in
               ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"))


def soak(server: ServerProcess, num_requests: int, concurrency: int, warmup: int, seed: int = 0) -> SoakReport:
    engine = engine_core_pid(server.pid)
    asyncio.run(_load(server.base_url, warmup, concurrency, seed + 1, SoakReport()))
    wait_until(lambda: engine_is_empty(server), timeout=120, what="the engine to be idle after the warm-up")
    before = rss_mib(server.pid), rss_mib(engine)
    report = SoakReport()
    started = time.monotonic()
    asyncio.run(_load(server.base_url, num_requests, concurrency, seed, report))
    report.seconds = time.monotonic() - started
    wait_until(lambda: engine_is_empty(server), timeout=120, what="the engine to be idle after the soak")
    report.server_rss, report.engine_rss = (before[0], rss_mib(server.pid)), (before[1], rss_mib(engine))
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("model_dir", nargs="?", help="model folder (default: a fresh tiny checkpoint)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        model_dir = args.model_dir
        if model_dir is None:
            from kvpilot.runtime.tiny_model import make_tiny_model

            model_dir = make_tiny_model(Path(workdir) / "tiny")
        server = start_server(Path(model_dir), Path(workdir), "--served-model-name", "tiny")
        try:
            report = soak(server, args.requests, args.concurrency, args.warmup)
        finally:
            server.stop()
    print("\n".join(report.lines()))
    ok = not report.usage_errors and report.rss_growth() <= RSS_TOLERANCE
    for error in report.usage_errors[:10]:
        print("  ", error, file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
