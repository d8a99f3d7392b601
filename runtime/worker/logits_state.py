"""Per-request state of the logits adjustments (layers/logits_processors.py), kept across steps.

Keyed by request id, so the input batch may move rows freely. Only requests that ask for an
adjustment have an entry, and a step's LogitsAdjustments is None when no scheduled request has
one. Penalties need per-token statistics: a prompt mask and output token counts, one row of
[vocab] each per penalised request, in tensors on the model's device that grow on demand and are
updated with one scatter per step from the sampled tokens. A preempted request is dropped and
rebuilt from its tokens when it resumes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvpilot.runtime.core.sched.output import NewRequestData
from kvpilot.runtime.layers.logits_processors import LogitsAdjustments, Penalties, banned_bad_word_tokens
from kvpilot.runtime.worker.device_copy import to_device


@dataclass(frozen=True)
class _MinTokens:
    min_tokens: int
    # What may not be sampled before min_tokens: EOS and the stop tokens, as vLLM masks them.
    stop_token_ids: tuple[int, ...]


class LogitsState:
    def __init__(self, vocab_size: int, eos_token_ids: list[int], device: torch.device) -> None:
        self.vocab_size = vocab_size
        # Every EOS of the checkpoint: none may be sampled before min_tokens.
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = device
        self.logit_bias: dict[str, dict[int, float]] = {}
        # Request id -> [V] bool, True for the tokens outside its allowed_token_ids.
        self.disallowed: dict[str, torch.Tensor] = {}
        self.bad_words: dict[str, list[list[int]]] = {}
        self.min_tokens: dict[str, _MinTokens] = {}
        # Request id -> (slot in the statistics tensors, (presence, frequency, repetition)).
        self.penalised: dict[str, tuple[int, tuple[float, float, float]]] = {}
        self._free_slots: list[int] = []
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)

    def add_request(self, new: NewRequestData) -> None:
        req_id, params = new.req_id, new.sampling_params
        if params.logit_bias:
            self.logit_bias[req_id] = params.logit_bias
        if params.allowed_token_ids is not None:
            mask = torch.ones(self.vocab_size, dtype=torch.bool, device=self.device)
            mask[to_device(params.allowed_token_ids, self.device)] = False
            self.disallowed[req_id] = mask
        if params.bad_words_token_ids:
            self.bad_words[req_id] = params.bad_words_token_ids
        if params.min_tokens > 0:
            self.min_tokens[req_id] = _MinTokens(
                params.min_tokens, tuple(dict.fromkeys(self.eos_token_ids + tuple(params.stop_token_ids))))
        if params.has_penalties:
            self._add_penalties(new)

    def remove_request(self, req_id: str) -> None:
        self.logit_bias.pop(req_id, None)
        self.disallowed.pop(req_id, None)
        self.bad_words.pop(req_id, None)
        self.min_tokens.pop(req_id, None)
        entry = self.penalised.pop(req_id, None)
        if entry is not None:
            self._free_slots.append(entry[0])

    def adjustments(self, req_ids: list[str], output_tokens) -> LogitsAdjustments | None:
        """The adjustments for one step's sampled rows (`req_ids`, in row order).

        Each part returns at once while no request in the batch uses it, so a batch without any
        costs four empty-dict checks per step, not a scan of its rows.

        `output_tokens(i)` is row i's output so far (a host array), needed for bad words and min_tokens.
        """
        result = LogitsAdjustments(
            disallowed=self._disallowed(req_ids),
            banned=self._banned(req_ids, output_tokens),
            logit_bias=self._logit_bias(req_ids),
            penalties=self._penalties(req_ids),
        )
        parts = (result.disallowed, result.banned, result.logit_bias, result.penalties)
        return None if all(part is None for part in parts) else result

    def record_sampled(self, req_ids: list[str], sampled: torch.Tensor) -> None:
        """Count each penalised row's sampled token (`sampled[i]` is `req_ids[i]`'s)."""
        if not self.penalised:
            return
        rows = [i for i, r in enumerate(req_ids) if r in self.penalised]
        if not rows:
            return
        slots = to_device([self.penalised[req_ids[i]][0] for i in rows], self.device)
        tokens = sampled[to_device(rows, sampled.device)]
        self.output_counts.index_put_((slots, tokens), torch.ones_like(slots, dtype=torch.int32), accumulate=True)

    # -- one step -----------------------------------------------------------------------------------

    def _disallowed(self, req_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.disallowed:
            return None
        rows = [i for i, r in enumerate(req_ids) if r in self.disallowed]
        if not rows:
            return None
        return (to_device(rows, self.device),
                torch.stack([self.disallowed[req_ids[i]] for i in rows]))

    def _banned(self, req_ids: list[str], output_tokens) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.bad_words and not self.min_tokens:
            return None
        pairs = []
        for i, req_id in enumerate(req_ids):
            words, minimum = self.bad_words.get(req_id), self.min_tokens.get(req_id)
            if words is None and minimum is None:
                continue
            output = output_tokens(i)
            if minimum is not None and len(output) < minimum.min_tokens:
                pairs += [(i, token) for token in minimum.stop_token_ids]
            if words is not None:
                # Only the tail a word's prefix could match is needed.
                context = max(map(len, words)) - 1
                tail = output[-context:].tolist() if context else []
                pairs += [(i, token) for token in banned_bad_word_tokens(words, tail)]
        if not pairs:
            return None
        rows, tokens = zip(*pairs)
        return to_device(rows, self.device), to_device(tokens, self.device)

    def _logit_bias(self, req_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if not self.logit_bias:
            return None
        entries = [(i, token, bias) for i, r in enumerate(req_ids) for token, bias in self.logit_bias.get(r, {}).items()]
        if not entries:
            return None
        rows, tokens, biases = zip(*entries)
        return (to_device(rows, self.device), to_device(tokens, self.device),
                to_device(biases, self.device, torch.float32))

    def _penalties(self, req_ids: list[str]) -> Penalties | None:
        if not self.penalised:
            return None
        rows = [i for i, r in enumerate(req_ids) if r in self.penalised]
        if not rows:
            return None
        slots = to_device([self.penalised[req_ids[i]][0] for i in rows], self.device)
        presence, frequency, repetition = (
            to_device(values, self.device, torch.float32)
            for values in zip(*(self.penalised[req_ids[i]][1] for i in rows))
        )
        return Penalties(rows=to_device(rows, self.device), prompt_mask=self.prompt_mask[slots],
                         output_counts=self.output_counts[slots], presence=presence, frequency=frequency,
                         repetition=repetition)

    # -- penalty statistics -------------------------------------------------------------------------

    def _add_penalties(self, new: NewRequestData) -> None:
        params = new.sampling_params
        slot = self._take_slot()
        self.penalised[new.req_id] = (slot, (params.presence_penalty, params.frequency_penalty,
                                             params.repetition_penalty))
        tokens = to_device(np.asarray(new.token_ids, dtype=np.int64), self.device)
        prompt, output = tokens[: new.num_prompt_tokens], tokens[new.num_prompt_tokens:]
        self.prompt_mask[slot] = False
        self.prompt_mask[slot, prompt] = True
        # A request resumed after preemption brings the output it had produced.
        self.output_counts[slot] = torch.bincount(output, minlength=self.vocab_size).to(torch.int32)

    def _take_slot(self) -> int:
        if not self._free_slots:
            capacity = self.prompt_mask.shape[0]
            grown = max(1, 2 * capacity)
            self.prompt_mask = _grown(self.prompt_mask, grown)
            self.output_counts = _grown(self.output_counts, grown)
            self._free_slots = list(range(grown - 1, capacity - 1, -1))
        return self._free_slots.pop()


def _grown(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    bigger = torch.zeros(rows, *tensor.shape[1:], dtype=tensor.dtype, device=tensor.device)
    bigger[: tensor.shape[0]] = tensor
    return bigger
