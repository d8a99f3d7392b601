"""A profile from the real engine on this machine: the engine's own steps timed one by one over
batch sizes and context lengths, and the profile's three step-cost coefficients fitted to them
by least squares.

Each point is one offline `LLM` run of `batch` distinct random prompts of `context` tokens that
generates 1 + decode_steps tokens each (ignore_eos). With the token budget at the largest
batch x context, its first step prefills every prompt at once (tokens = context = batch x
context) and each of the next decode_steps steps decodes one token per request (tokens = batch,
context = batch x (context + j) after step j). Every EngineCore.step() is timed on its own, so
the per-call work of `generate` (adding requests, output processing, detokenizing) stays out of
the step cost, as it does in the server, where the API-server process does it. Prefix caching is
off, so that no prompt shares another's blocks.

On a shared machine a step's wall time includes the time its threads waited for a core, which
depends on what else ran then. Each step is timed by its wall time x the share of its threads'
runnable time that they ran (Linux's schedstat): its time on a machine with a core free for each
thread. The profile records the share over all the steps (1 on a quiet machine).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvpilot.operator.sim.profile import Profile


def run_queue_seconds(pid: int | str = "self") -> tuple[float, float]:
    """Seconds a process's threads, all together, have run on a core and waited runnable for
    one (Linux's /proc/PID/task/*/schedstat); (0, 0) where the kernel does not say."""
    on_cpu = waiting = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        with contextlib.suppress(OSError, ValueError):  # a thread that ended meanwhile
            ran, waited, _ = stat.read_text().split()
            on_cpu, waiting = on_cpu + int(ran), waiting + int(waited)
    return on_cpu / 1e9, waiting / 1e9


def cpu_share(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """Of the time the threads were runnable between two run_queue_seconds, the share they ran:
    1 on a machine with a core free whenever one was wanted, less on a shared one."""
    ran, waited = after[0] - before[0], after[1] - before[1]
    return ran / (ran + waited) if ran > 0 else None


class _TimedSteps:
    """The EngineCore, with the time of each step() it runs recorded, and its threads' time on
    and waiting for a core over them all."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.seconds: list[float] = []
        self.run_queue = (0.0, 0.0)

    def step(self):
        before = run_queue_seconds()
        started = time.perf_counter()
        outputs = self._engine.step()
        wall = time.perf_counter() - started
        after = run_queue_seconds()
        # Its time with a core for each thread whenever it wanted one: the wall time less the
        # waits for a core that a shared machine adds (a quiet one adds none).
        share = cpu_share(before, after)
        self.seconds.append(wall if share is None else wall * share)
        self.run_queue = (self.run_queue[0] + after[0] - before[0], self.run_queue[1] + after[1] - before[1])
        return outputs

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def calibrate(model: str, *, batch_sizes: Sequence[int], context_lens: Sequence[int], decode_steps: int,
              num_gpu_blocks: int, block_size: int = 16, seed: int = 0) -> Profile:
    from kvpilot.runtime.engine.llm import LLM
    from kvpilot.runtime.request import SamplingParams

    largest = max(batch_sizes) * max(context_lens)
    llm = LLM(model, num_gpu_blocks_override=num_gpu_blocks, block_size=block_size, enable_prefix_caching=False,
              max_num_seqs=max(batch_sizes), max_num_batched_tokens=largest, seed=seed)
    timed = llm.engine = _TimedSteps(llm.engine)
    rng = np.random.default_rng(seed)
    vocab = llm.tokenizer.get_vocab_size()

    def steps(batch: int, context: int) -> list[float]:
        prompts = [rng.integers(1, vocab, size=context).tolist() for _ in range(batch)]
        timed.seconds = []
        llm.generate(prompts, SamplingParams(max_tokens=1 + decode_steps, ignore_eos=True, temperature=0.0))
        # The last call finds nothing left to run.
        ran = [s for s in timed.seconds[:-1]] if len(timed.seconds) == decode_steps + 2 else timed.seconds
        if len(ran) != 1 + decode_steps:
            raise RuntimeError(f"expected one prefill and {decode_steps} decode steps, the engine ran {len(ran)}")
        return ran

    steps(min(batch_sizes), min(context_lens))  # warm-up: first calls pay for allocation and compilation
    rows, times = [], []
    timed.run_queue = (0.0, 0.0)
    for batch in batch_sizes:
        for context in context_lens:
            prefill, *decodes = steps(batch, context)
            rows.append((1.0, batch * context, batch, batch * context))
            times.append(prefill)
            for j, seconds in enumerate(decodes, start=1):
                rows.append((1.0, batch, batch, batch * (context + j)))
                times.append(seconds)
    coefficients = _non_negative_least_squares(np.asarray(rows), np.asarray(times))
    return Profile(
        name=f"{model} on this machine",
        source=f"kvpilot simulate calibrate: {len(times)} engine steps timed over batches {list(batch_sizes)},"
               f" contexts {list(context_lens)}, {decode_steps} decode steps per point",
        base_s=float(coefficients[0]), per_token_s=float(coefficients[1]), per_sequence_s=float(coefficients[2]),
        per_context_token_s=float(coefficients[3]), num_gpu_blocks=num_gpu_blocks - 1, block_size=block_size,
        cpu_share=cpu_share((0.0, 0.0), timed.run_queue),
    )


def _non_negative_least_squares(rows: np.ndarray, times: np.ndarray) -> np.ndarray:
    """Least squares with each coefficient >= 0: a negative one is fixed at 0 and the rest refitted."""
    free = np.ones(rows.shape[1], bool)
    while True:
        solution = np.zeros(rows.shape[1])
        solution[free] = np.linalg.lstsq(rows[:, free], times, rcond=None)[0]
        if (solution >= 0).all():
            return solution
        free &= solution > 0
