"""What changes a batch's logits before sampling, beyond temperature and the top-k/p filters.

In vLLM's order: the allowed-token whitelist and the banned tokens (bad words, and the stop
tokens a request may not sample before `min_tokens`) set logits to -inf, then the logit bias is
added, then the repetition, frequency and presence penalties apply, in that order. Each part holds
only the rows that asked for it, so a batch without any pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Penalties:
    """vLLM's penalties for the rows that have any (`rows` of the batch, in step order)."""

    rows: torch.Tensor  # [P] int64
    # Tokens that occur in the row's prompt.
    prompt_mask: torch.Tensor  # [P, V] bool
    # How often each token occurs in the row's output so far.
    output_counts: torch.Tensor  # [P, V] int32
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    repetition: torch.Tensor  # [P] float32


@dataclass
class LogitsAdjustments:
    # (rows [A], mask [A, V]): True where the row may not sample the token.
    disallowed: tuple[torch.Tensor, torch.Tensor] | None = None
    # (rows, token ids) set to -inf.
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    # (rows, token ids, biases) added to the logits.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    penalties: Penalties | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The adjusted logits [B, V] (float32); `logits` itself is left as it was."""
        if self.disallowed is not None:
            rows, mask = self.disallowed
            logits = logits.index_put((rows,), logits[rows].masked_fill(mask, float("-inf")))
        if self.banned is not None:
            rows, tokens = self.banned
            logits = logits.index_put((rows, tokens), torch.full((), float("-inf"), device=logits.device))
        if self.logit_bias is not None:
            rows, tokens, biases = self.logit_bias
            logits = logits.index_put((rows, tokens), biases, accumulate=True)
        if self.penalties is not None:
            logits = apply_penalties(logits, self.penalties)
        return logits


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """vLLM's formula: a token seen in the prompt or the output has a positive logit divided by
    the repetition penalty and a negative one multiplied by it (CTRL's); then OpenAI's frequency
    penalty (times the output count) and presence penalty (once, if in the output) are subtracted."""
    rows = penalties.rows
    row_logits = logits[rows]
    counts = penalties.output_counts.to(row_logits.dtype)
    in_output = penalties.output_counts > 0
    repetition = penalties.repetition.unsqueeze(-1)
    scaled = torch.where(row_logits > 0, row_logits / repetition, row_logits * repetition)
    row_logits = torch.where(penalties.prompt_mask | in_output, scaled, row_logits)
    row_logits = row_logits - penalties.frequency.unsqueeze(-1) * counts
    row_logits = row_logits - penalties.presence.unsqueeze(-1) * in_output.to(row_logits.dtype)
    return logits.index_put((rows,), row_logits)


def banned_bad_word_tokens(bad_words: list[list[int]], output: list[int]) -> list[int]:
    """vLLM's bad words: a word's last token is banned where the output so far ends with the
    word's other tokens (a one-token word is banned everywhere)."""
    banned = []
    for word in bad_words:
        prefix = word[:-1]
        if len(prefix) <= len(output) and (not prefix or output[-len(prefix):] == prefix):
            banned.append(word[-1])
    return banned
