"""Multi-turn conversations, each turn's prompt the whole conversation so far: the workload a
prefix-aware router is for. Shared by the router's end-to-end test and its benchmark.

Every turn is a streamed, greedy chat completion; conversations run concurrently, the turns of
one in order, and turn t of conversation c goes to `base_urls[(c + t) % len(base_urls)]`, so that
with several routers the turns of one conversation cross them.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx

from kvpilot.runtime.benchmarks.datasets import random_words


@dataclass(frozen=True)
class Turn:
    conversation: int
    turn: int
    answer: str
    # Seconds from sending the turn to its first content token, and to its end.
    ttft_s: float
    latency_s: float


def conversation_questions(num_conversations: int, num_turns: int, words_per_turn: int, seed: int,
                           words_first_turn: int | None = None) -> list[list[str]]:
    """The user messages of each conversation; the first may be longer (a document to talk about)."""
    rng = random.Random(seed)
    first = words_first_turn or words_per_turn
    return [[random_words(rng, first if turn == 0 else words_per_turn) for turn in range(num_turns)]
            for _ in range(num_conversations)]


async def run_conversations(base_urls: list[str], questions: list[list[str]], *, model: str, max_tokens: int,
                            concurrency: int, cache_salt: str | None = None, timeout: float = 120.0
                            ) -> list[list[Turn]]:
    """Every conversation's turns, in order; raises on any failed turn."""
    slots = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=timeout) as client:

        async def converse(index: int, asked: list[str]) -> list[Turn]:
            messages, turns = [], []
            async with slots:
                for number, question in enumerate(asked):
                    messages.append({"role": "user", "content": question})
                    url = base_urls[(index + number) % len(base_urls)]
                    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, **({"cache_salt": cache_salt} if cache_salt else {})}
                    turn = await _turn(client, url, body, index, number)
                    turns.append(turn)
                    messages.append({"role": "assistant", "content": turn.answer})
            return turns

        return list(await asyncio.gather(*(converse(i, asked) for i, asked in enumerate(questions))))


async def _turn(client: httpx.AsyncClient, url: str, body: dict, conversation: int, number: int) -> Turn:
    started = time.perf_counter()
    first = None
    parts = []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"turn {number} of conversation {conversation}: {response.status_code} "
                               f"{(await response.aread()).decode(errors='replace')[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(f"turn {number} of conversation {conversation}: {chunk['error']}")
            content = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if content:
                first = first or time.perf_counter()
                parts.append(content)
    ended = time.perf_counter()
    return Turn(conversation, number, "".join(parts), (first or ended) - started, ended - started)
