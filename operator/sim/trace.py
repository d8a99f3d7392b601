"""Arrivals: who asks for how many tokens, when.

A trace file is CSV with the header `timestamp,tenant,prompt_tokens,output_tokens`, or JSONL with
those keys per line: `timestamp` in seconds from the trace's start (>= 0, any order), `tenant` a
name, the two lengths positive integers (`output_tokens`: what the request generates, as with
`ignore_eos`). The built-in generators draw the same shape from a seed; `multi_turn` also draws
conversations, whose turns share their prompts' prefixes (a file's requests share none).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

COLUMNS = ("timestamp", "tenant", "prompt_tokens", "output_tokens")
DAY = 86400.0
# Lengths are drawn uniformly within this share either side of their mean.
LENGTH_SPREAD = 0.5
FLASH_FACTOR = 10.0
FLASH_RAMP_S = 60.0


@dataclass(frozen=True)
class Trace:
    time: np.ndarray  # float64 seconds, sorted
    tenant: np.ndarray  # int16 index into `tenants`
    prompt: np.ndarray  # int64
    output: np.ndarray  # int64
    tenants: tuple[str, ...]
    duration: float  # arrivals lie in [0, duration)
    rate: Callable[[np.ndarray], np.ndarray] | None = None  # the generator's intensity, where known
    # Each request's conversation, from 1 (0: it shares no prefix with any other request). Turn k's
    # prompt is turn k-1's prompt and output, then its own message: the tokens of a conversation
    # only ever grow, so block j of any of its prompts is the same block.
    conversation: np.ndarray | None = None
    # The system prompt's tokens, at the head of every conversation's prompts.
    shared_tokens: int = 0

    def __len__(self) -> int:
        return len(self.time)

    def mean_rate(self) -> float:
        return len(self) / self.duration

    def arrivals(self, start: float, end: float) -> int:
        """Requests arriving in [start, end)."""
        return int(np.searchsorted(self.time, end) - np.searchsorted(self.time, start))

    def peak_rate(self, window_s: float = 60.0) -> float:
        """The busiest window's arrivals per second (the intensity's maximum, where known)."""
        if self.rate is not None:
            grid = np.linspace(0.0, self.duration, 10_001)
            return float(self.rate(grid).max())
        counts = np.bincount((self.time // window_s).astype(np.int64))
        return float(counts.max()) / window_s if len(counts) else 0.0


def _lengths(rng: np.random.Generator, mean: int, count: int) -> np.ndarray:
    low = max(1, round(mean * (1 - LENGTH_SPREAD)))
    high = max(low, round(mean * (1 + LENGTH_SPREAD)))
    return rng.integers(low, high + 1, size=count, dtype=np.int64)


def _arrivals(rng: np.random.Generator, rate: Callable[[np.ndarray], np.ndarray], peak: float,
              duration: float) -> np.ndarray:
    """A Poisson process of intensity `rate(t)` <= `peak`, by thinning."""
    times = np.sort(rng.uniform(0.0, duration, size=rng.poisson(peak * duration)))
    return times[rng.uniform(0.0, peak, size=len(times)) < rate(times)]


def _one_tenant(rng: np.random.Generator, rate: Callable[[np.ndarray], np.ndarray], peak: float,
                duration: float, prompt_tokens: int, output_tokens: int, tenant: str = "default") -> Trace:
    times = _arrivals(rng, rate, peak, duration)
    return Trace(times, np.zeros(len(times), np.int16), _lengths(rng, prompt_tokens, len(times)),
                 _lengths(rng, output_tokens, len(times)), (tenant,), duration, rate)


Intensity = Callable[[np.ndarray], np.ndarray]


def _steady(rate: float, duration: float) -> tuple[Intensity, float]:
    return (lambda t: np.full_like(t, rate)), rate


def _day(rate: float, duration: float, amplitude: float = 0.6) -> tuple[Intensity, float]:
    """A day's sine around the mean `rate`, from the night's trough to the peak at midday."""
    def intensity(t: np.ndarray) -> np.ndarray:
        return rate * (1 - amplitude * np.cos(2 * math.pi * t / DAY))

    return intensity, rate * (1 + amplitude)


def _flash(rate: float, duration: float) -> tuple[Intensity, float]:
    """`rate`, then 10x within a minute from a third of the way in, back to `rate` at two thirds."""
    start, end = duration / 3, 2 * duration / 3

    def intensity(t: np.ndarray) -> np.ndarray:
        rise = np.clip((t - start) / FLASH_RAMP_S, 0.0, 1.0) * (t < end)
        return rate * (1 + (FLASH_FACTOR - 1) * rise)

    return intensity, rate * FLASH_FACTOR


# The arrival patterns, each an intensity from a mean or base rate and the trace's duration.
PATTERNS: Mapping[str, Callable[[float, float], tuple[Intensity, float]]] = {
    "poisson": _steady, "diurnal": _day, "flash-crowd": _flash,
}


def poisson(rate: float, duration: float, prompt_tokens: int, output_tokens: int, seed: int) -> Trace:
    return _one_tenant(np.random.default_rng(seed), *_steady(rate, duration), duration, prompt_tokens, output_tokens)


def diurnal(rate: float, duration: float, prompt_tokens: int, output_tokens: int, seed: int) -> Trace:
    return _one_tenant(np.random.default_rng(seed), *_day(rate, duration), duration, prompt_tokens, output_tokens)


def flash_crowd(rate: float, duration: float, prompt_tokens: int, output_tokens: int, seed: int) -> Trace:
    return _one_tenant(np.random.default_rng(seed), *_flash(rate, duration), duration, prompt_tokens, output_tokens)


TURNS = 4
THINK_SECONDS = 30.0
SYSTEM_TOKENS = 1000


def multi_turn(rate: float, duration: float, prompt_tokens: int, output_tokens: int, seed: int, *,
               turns: int = TURNS, think_seconds: float = THINK_SECONDS, system_tokens: int = SYSTEM_TOKENS,
               pattern: str = "poisson") -> Trace:
    """Chat conversations. They start by `pattern` (PATTERNS) at `rate / turns`, so that requests
    come at about `rate`, and have 1 to 2 turns - 1 turns (uniformly: `turns` on average). Each
    turn sends a message of about `prompt_tokens` after the conversation so far (the system
    prompt of `system_tokens`, every earlier message and output), and gets about `output_tokens`.
    A turn comes an exponential `think_seconds` after the one before (the trace is open: the
    user's reading of the reply is in the gap, however long the reply takes here)."""
    rng = np.random.default_rng(seed)
    intensity, peak = PATTERNS[pattern](rate / turns, duration)
    starts = _arrivals(rng, intensity, peak, duration)
    count = rng.integers(1, 2 * turns, size=len(starts))
    first = np.cumsum(count) - count  # each conversation's first request
    total = int(count.sum())
    message, output = _lengths(rng, prompt_tokens, total), _lengths(rng, output_tokens, total)
    gaps = rng.exponential(think_seconds, total)
    gaps[first] = 0.0
    time = np.repeat(starts, count) + _running_sum(gaps, first, count)
    exchanged = message + output
    prompt = system_tokens + _running_sum(exchanged, first, count) - exchanged + message
    conversation = np.repeat(np.arange(1, len(starts) + 1), count)
    kept = np.flatnonzero(time < duration)
    order = kept[np.argsort(time[kept], kind="stable")]
    return Trace(time[order], np.zeros(len(order), np.int16), prompt[order], output[order], ("default",), duration,
                 conversation=conversation[order], shared_tokens=system_tokens)


def _running_sum(values: np.ndarray, first: np.ndarray, count: np.ndarray) -> np.ndarray:
    """The sum of `values` so far within each group (`first`: the groups' starts, `count`: sizes)."""
    total = np.cumsum(values)
    return total - np.repeat(total[first] - values[first], count)


def two_tenant(rate: float, duration: float, prompt_tokens: int, output_tokens: int, seed: int) -> Trace:
    """`interactive` trickles at a fifth of `rate` all along, with the given lengths; `batch`
    floods at `rate` over the middle third with prompts and outputs four times as long."""
    rng = np.random.default_rng(seed)
    interactive = _one_tenant(rng, lambda t: np.full_like(t, rate / 5), rate / 5, duration,
                              prompt_tokens, output_tokens)
    start, end = duration / 3, 2 * duration / 3
    flood = _one_tenant(rng, lambda t: rate * ((t >= start) & (t < end)), rate, duration,
                        4 * prompt_tokens, 4 * output_tokens)
    return merged([("interactive", interactive), ("batch", flood)], duration)


def merged(parts: Sequence[tuple[str, Trace]], duration: float) -> Trace:
    """One trace from single-tenant ones, each named."""
    time = np.concatenate([part.time for _, part in parts])
    order = np.argsort(time, kind="stable")
    tenant = np.concatenate([np.full(len(part), i, np.int16) for i, (_, part) in enumerate(parts)])
    return Trace(time[order], tenant[order], np.concatenate([p.prompt for _, p in parts])[order],
                 np.concatenate([p.output for _, p in parts])[order], tuple(name for name, _ in parts), duration)


GENERATORS: Mapping[str, Callable[..., Trace]] = {
    "poisson": poisson, "diurnal": diurnal, "flash-crowd": flash_crowd, "two-tenant": two_tenant,
}


def read(path: Path) -> Trace:
    """A CSV or JSONL trace file (by its suffix: .jsonl is JSONL, anything else CSV)."""
    try:
        with path.open(newline="") as file:
            if path.suffix == ".jsonl":
                rows = list(_jsonl_rows(file))
            else:
                reader = csv.DictReader(file)
                if reader.fieldnames is None or set(COLUMNS) - set(reader.fieldnames):
                    raise ValueError(f"the header must name {', '.join(COLUMNS)}")
                rows = [(line, row) for line, row in enumerate(reader, start=2)]
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error}") from error
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from error
    return _from_rows(path, rows)


def _jsonl_rows(file: Iterable[str]) -> Iterable[tuple[int, Mapping]]:
    for line, text in enumerate(file, start=1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"line {line}: not JSON ({error.msg})") from error
        if not isinstance(row, dict):
            raise ValueError(f"line {line}: not a JSON object")
        yield line, row


def _from_rows(path: Path, rows: Sequence[tuple[int, Mapping]]) -> Trace:
    if not rows:
        raise ValueError(f"{path}: no requests")
    tenants: dict[str, int] = {}
    times, codes, prompts, outputs = [], [], [], []
    for line, row in rows:
        try:
            time = float(row["timestamp"])
            prompt, output = int(row["prompt_tokens"]), int(row["output_tokens"])
            tenant = str(row["tenant"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path} line {line}: needs {', '.join(COLUMNS)} ({error})") from error
        if not math.isfinite(time) or time < 0 or prompt < 1 or output < 1:
            raise ValueError(f"{path} line {line}: timestamp must be >= 0 and the token counts >= 1")
        times.append(time)
        codes.append(tenants.setdefault(tenant, len(tenants)))
        prompts.append(prompt)
        outputs.append(output)
    time_array = np.asarray(times)
    order = np.argsort(time_array, kind="stable")
    duration = float(time_array.max()) + 1e-9
    return Trace(time_array[order], np.asarray(codes, np.int16)[order], np.asarray(prompts, np.int64)[order],
                 np.asarray(outputs, np.int64)[order], tuple(tenants), duration)
