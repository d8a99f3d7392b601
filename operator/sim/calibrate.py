"""A profile from the real engine on this machine: offline `LLM` runs timed over batch sizes and
context lengths, and the profile's three step-cost coefficients fitted to them by least squares.

Each point is two runs of `batch` distinct random prompts of `context` tokens: one that only
prefills (max_tokens 1), and one that also decodes `decode_steps` more tokens (ignore_eos). The
first gives a prefill step's time; the difference, divided by decode_steps, a decode step's at
that batch and mean context. Prefix caching is off, so that no prompt shares another's blocks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from kvpilot.operator.sim.profile import Profile


def calibrate(model: str, *, batch_sizes: Sequence[int], context_lens: Sequence[int], decode_steps: int,
              num_gpu_blocks: int, block_size: int = 16, seed: int = 0) -> Profile:
    from kvpilot.runtime.engine.llm import LLM
    from kvpilot.runtime.request import SamplingParams

    largest = max(batch_sizes) * max(context_lens)
    llm = LLM(model, num_gpu_blocks_override=num_gpu_blocks, block_size=block_size, enable_prefix_caching=False,
              max_num_seqs=max(batch_sizes), max_num_batched_tokens=largest, seed=seed)
    rng = np.random.default_rng(seed)
    vocab = llm.tokenizer.get_vocab_size()

    def seconds(batch: int, context: int, max_tokens: int) -> float:
        prompts = [rng.integers(1, vocab, size=context).tolist() for _ in range(batch)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        started = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - started

    seconds(1, min(context_lens), 2)  # warm-up: first calls pay for allocation and compilation
    rows, times = [], []
    for batch in batch_sizes:
        for context in context_lens:
            prefill = seconds(batch, context, 1)
            decode = (seconds(batch, context, 1 + decode_steps) - prefill) / decode_steps
            rows.append((1.0, batch * context, batch * context))
            times.append(prefill)
            rows.append((1.0, batch, batch * (context + 1 + decode_steps / 2)))
            times.append(max(decode, 0.0))
    coefficients = _non_negative_least_squares(np.asarray(rows), np.asarray(times))
    return Profile(
        name=f"{model} on this machine",
        source=f"kvpilot simulate calibrate: batches {list(batch_sizes)}, contexts {list(context_lens)},"
               f" {decode_steps} decode steps per point",
        base_s=float(coefficients[0]), per_token_s=float(coefficients[1]),
        per_context_token_s=float(coefficients[2]), num_gpu_blocks=num_gpu_blocks - 1, block_size=block_size,
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
