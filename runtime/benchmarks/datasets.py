"""What a benchmark sends: prompts, with how many tokens each should generate, and when.

Prompts are text, so that the same run works against any OpenAI-compatible server and on both
the completions and the chat endpoint. Their length is set in words from a fixed word list (a
word is about one token for common English words); the token counts that the reports use are
the server's own, from each response's `usage`.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Common short English words: nearly every tokenizer has each as a single token.
_WORDS = (
    "the of and to in is was for on that with as by at from his her an be this which or had are "
    "not but have they one you were all their we been has there more when will would who so if "
    "no out up into them can only other new some time could these two may first then do any like "
    "my now over such our man me even most made after also did many off before must well back "
    "through years much where your way down should because each just those people how too little "
    "state good very make world still own see men work long get here between both life being under "
    "never day same another know while last might us great old year come since against go came "
    "right used take three place house small found again light water city tree river stone road"
).split()


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    output_len: int


def random_words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(count))


def random_dataset(num_prompts: int, input_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest(random_words(rng, input_len), output_len) for _ in range(num_prompts)]


def shared_prefix_dataset(num_prompts: int, prefix_len: int, input_len: int, output_len: int,
                          seed: int) -> list[BenchRequest]:
    """One common prefix of `prefix_len` words, then `input_len` words of each request's own."""
    rng = random.Random(seed)
    prefix = random_words(rng, prefix_len)
    return [BenchRequest(f"{prefix} {random_words(rng, input_len)}", output_len) for _ in range(num_prompts)]


def file_dataset(path: Path, num_prompts: int, output_len: int) -> list[BenchRequest]:
    """A JSONL file, one `{"prompt": "...", "output_len": N}` per line (`output_len` optional:
    `--output-len` otherwise). Lines are used in order, cycling if `num_prompts` asks for more."""
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            prompt = record["prompt"]
            wanted = int(record.get("output_len", output_len))
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}:{number}: expected {{\"prompt\": str, \"output_len\": int}}: {err}") from None
        if not isinstance(prompt, str) or not prompt or wanted < 1:
            raise ValueError(f"{path}:{number}: prompt must be a non-empty string and output_len at least 1")
        entries.append(BenchRequest(prompt, wanted))
    if not entries:
        raise ValueError(f"{path}: no prompts")
    return [entries[i % len(entries)] for i in range(num_prompts)]


def warmup_requests(count: int) -> list[BenchRequest]:
    """Short requests of their own words, so that the timed prompts never hit a warmed prefix cache."""
    rng = random.Random("warm-up")
    return [BenchRequest(random_words(rng, 8), 4) for _ in range(count)]


def arrival_gaps(request_rate: float, count: int, seed: int) -> Iterator[float]:
    """Seconds to wait before each request: a Poisson process at `request_rate` requests/s
    (exponential gaps), or no waiting at all when the rate is infinite."""
    rng = random.Random(seed)
    for _ in range(count):
        yield 0.0 if math.isinf(request_rate) else rng.expovariate(request_rate)
