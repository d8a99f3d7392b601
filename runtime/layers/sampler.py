"""Turns a batch of logits into next tokens: greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

The logits are first adjusted (allowed tokens, bad words, min_tokens, logit bias, penalties: see
logits_processors.py) for the rows that ask for it; greedy rows then take the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.runtime.layers.logits_processors import LogitsAdjustments
from kvpilot.runtime.request import GREEDY_TEMPERATURE


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of one step; a None tensor means the filter is off for every row."""

    temperature: torch.Tensor  # [B] float32; rows below GREEDY_TEMPERATURE are greedy
    top_k: torch.Tensor | None  # [B] int64; 0 or -1 turns it off for that row
    top_p: torch.Tensor | None  # [B] float32; 1.0 turns it off for that row
    min_p: torch.Tensor | None  # [B] float32; 0.0 turns it off for that row
    # Row index -> the generator of a request that has its own seed.
    generators: dict[int, torch.Generator]
    # The largest `logprobs` N in the batch; None when no request asked for logprobs.
    max_num_logprobs: int | None
    all_greedy: bool
    all_random: bool
    # None when no row has a logit bias, penalties or a token restriction.
    adjustments: LogitsAdjustments | None = None
    # (rows, packed int32 masks [len(rows), ceil(V / 32)]) of the rows under a grammar: bit t of
    # a row's mask set means token t is allowed. None when no row has a grammar.
    grammar_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class LogprobsTensors:
    token_ids: torch.Tensor  # [B, N+1] int64: the sampled (or given) token, then the top-N ids
    logprobs: torch.Tensor  # [B, N+1] float32
    ranks: torch.Tensor  # [B] int64: rank of column 0's token, 1 = most likely


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """The logprob and rank of `token_ids` in each row of `logprobs` [B, V], plus that row's top-N."""
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    token_ids = token_ids.long().unsqueeze(-1)
    token_logprobs = logprobs.gather(-1, token_ids)
    ranks = (logprobs > token_logprobs).sum(-1) + 1
    return LogprobsTensors(
        token_ids=torch.cat([token_ids, top_ids], dim=-1),
        logprobs=torch.cat([token_logprobs, top_logprobs], dim=-1),
        ranks=ranks,
    )


class Sampler(torch.nn.Module):
    def __init__(self, kernels: str = "torch") -> None:
        """`kernels`: the attention backend's name, as for the model's layers; with "cpu" the
        argmaxes run in C (fused_ops.c), with torch.argmax's results."""
        super().__init__()
        self._argmax = _torch_argmax
        if kernels == "cpu":
            # Imported here: a torch-only engine builds no C.
            from kvpilot.kernels.cpu.fused_ops import argmax, build

            build()  # a missing compiler fails the engine's start, not its first step

            # The rows it sees are float32 by now (`logits.float()`), on the cpu backend's CPU.
            self._argmax = argmax

    def forward(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        generator: torch.Generator | None = None,
    ) -> SamplerOutput:
        logits = logits.float()
        if metadata.grammar_bitmask is not None:
            # Before everything else, logprobs included, as vLLM applies it: a token the grammar
            # forbids has probability 0.
            logits = apply_grammar_bitmask(logits, *metadata.grammar_bitmask)
        raw_logits = logits
        if metadata.adjustments is not None:
            logits = metadata.adjustments.apply(logits)
        if metadata.all_random:
            sampled = _sample_random(logits, metadata, generator, self._argmax)
        else:
            # Greedy rows: the argmax of the logits as adjusted, with no temperature or filter in
            # between, so that greedy decoding matches transformers token for token.
            sampled = self._argmax(logits)
            if not metadata.all_greedy:
                is_greedy = metadata.temperature < GREEDY_TEMPERATURE
                sampled = torch.where(is_greedy, sampled, _sample_random(logits, metadata, generator, self._argmax))

        logprobs = None
        if metadata.max_num_logprobs is not None:
            # Logprobs describe the model's own distribution, untouched by the sampling filters,
            # the logit bias and the penalties (vLLM's default `raw_logprobs` mode).
            raw = raw_logits.log_softmax(dim=-1)
            logprobs = gather_logprobs(raw, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def apply_grammar_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` with -inf for each token a row's packed bitmask does not allow."""
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, : logits.shape[-1]]
    return logits.index_put((rows,), logits[rows].masked_fill(~allowed, float("-inf")))


def _torch_argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


def _sample_random(
    logits: torch.Tensor, metadata: SamplingMetadata, generator: torch.Generator | None, argmax
) -> torch.Tensor:
    # Greedy rows of a mixed batch get temperature 1 here so they stay finite; their result is
    # discarded by the caller.
    temperature = metadata.temperature.to(logits.dtype)
    temperature = torch.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature)
    logits = logits / temperature.unsqueeze(-1)
    if metadata.top_k is not None or metadata.top_p is not None:
        logits = _apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    probs = logits.softmax(dim=-1)
    if metadata.min_p is not None:
        # The row's top token always survives, since max_prob * min_p <= max_prob.
        threshold = probs.amax(dim=-1, keepdim=True) * metadata.min_p.unsqueeze(-1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    # Exponential race: argmax(p / q) with q ~ Exp(1) picks token i with probability p_i, needs
    # no normalisation after filtering, and lets each seeded row draw its own noise.
    return argmax(probs / _exponential_noise(probs, metadata.generators, generator))


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Masks to -inf every token outside the row's top-k, then outside its top-p nucleus."""
    vocab_size = logits.shape[-1]
    # Stable, so ties rank the lowest id first, as argmax does.
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)
        positions = torch.arange(vocab_size, device=logits.device)
        sorted_logits = sorted_logits.masked_fill(positions >= k.unsqueeze(-1), float("-inf"))
    if top_p is not None:
        sorted_probs = sorted_logits.softmax(dim=-1)
        # A token stays while the mass strictly above it is still short of top_p; the top token
        # has none above it, so it always stays. top_p = 1 rows are skipped outright, because
        # rounding in the cumulative sum could otherwise cut their tail.
        mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
        top_p = top_p.unsqueeze(-1)
        drop = (mass_above >= top_p) & (top_p < 1.0)
        # A top_p that rounds to 0 in float32 would otherwise drop the top token too.
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def skip_noise(generator: torch.Generator, num_tokens: int, vocab_size: int) -> None:
    """Advance a seeded row's generator past the noise of `num_tokens` sampled tokens: the draws
    _exponential_noise makes for them, one full vocabulary each, of the same size and dtype."""
    if num_tokens == 0:
        return
    noise = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
    for _ in range(num_tokens):
        noise.exponential_(generator=generator)


def _exponential_noise(
    probs: torch.Tensor, generators: dict[int, torch.Generator], generator: torch.Generator | None
) -> torch.Tensor:
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_(generator=generator)
    # A seeded row draws a full vocabulary of noise from its own generator, one draw per token,
    # so its tokens depend only on its seed, not on its batch neighbours or its row index.
    for row, row_generator in generators.items():
        q[row].exponential_(generator=row_generator)
    return q
