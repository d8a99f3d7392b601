"""The per-request state behind penalties and token restrictions: only the requests that ask
for one hold any, their statistics follow the sampled tokens, and a resumed request rebuilds them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpilot.runtime.core.sched.output import NewRequestData
from kvpilot.runtime.request import SamplingParams
from kvpilot.runtime.worker.logits_state import LogitsState

VOCAB, EOS = 12, 11


def _new(req_id: str, tokens: list[int], num_prompt: int | None = None, **params) -> NewRequestData:
    num_prompt = len(tokens) if num_prompt is None else num_prompt
    return NewRequestData(req_id=req_id, token_ids=tokens, num_prompt_tokens=num_prompt,
                          sampling_params=SamplingParams(**params), block_ids=[], num_computed_tokens=0)


def _state() -> LogitsState:
    return LogitsState(VOCAB, [EOS], torch.device("cpu"))


def _no_output(i: int) -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


def test_requests_without_adjustments_cost_nothing():
    state = _state()
    state.add_request(_new("plain", [1, 2, 3], temperature=0.5, top_k=3))
    assert state.adjustments(["plain"], _no_output) is None
    state.record_sampled(["plain"], torch.tensor([4]))
    assert state.prompt_mask.shape[0] == 0 and state.output_counts.shape[0] == 0


def test_penalty_statistics_follow_sampling_and_slots_are_reused():
    state = _state()
    state.add_request(_new("a", [1, 1, 2], repetition_penalty=1.2))
    state.add_request(_new("plain", [3]))
    state.add_request(_new("b", [5], presence_penalty=0.5))
    state.record_sampled(["a", "plain", "b"], torch.tensor([7, 8, 7]))
    state.record_sampled(["a", "b"], torch.tensor([7, 9]))
    penalties = state.adjustments(["b", "plain", "a"], _no_output).penalties
    # Rows in the step's order: "b" is row 0 and "a" row 2; "plain" has none.
    assert penalties.rows.tolist() == [0, 2]
    assert penalties.presence.tolist() == [0.5, 0.0] and penalties.repetition.tolist() == [1.0, pytest.approx(1.2)]
    assert penalties.prompt_mask[0].nonzero().flatten().tolist() == [5]
    assert penalties.prompt_mask[1].nonzero().flatten().tolist() == [1, 2]
    assert penalties.output_counts[0, 7] == 1 and penalties.output_counts[0, 9] == 1
    assert penalties.output_counts[1, 7] == 2 and penalties.output_counts[1].sum() == 2
    slot_of_a = state.penalised["a"][0]
    state.remove_request("a")
    state.add_request(_new("c", [4], frequency_penalty=1.0))
    assert state.penalised["c"][0] == slot_of_a
    counts = state.adjustments(["c"], _no_output).penalties.output_counts
    assert counts.sum() == 0, "a reused slot starts from the new request's own tokens"


def test_a_resumed_request_rebuilds_its_counts_from_its_tokens():
    state = _state()
    # Preempted after two outputs (6 and 6): they come back as tokens beyond the prompt.
    state.add_request(_new("a", [1, 2, 6, 6], num_prompt=2, frequency_penalty=1.0))
    penalties = state.adjustments(["a"], _no_output).penalties
    assert penalties.prompt_mask[0].nonzero().flatten().tolist() == [1, 2]
    assert penalties.output_counts[0, 6] == 2 and penalties.output_counts[0].sum() == 2


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    state = _state()
    state.add_request(_new("a", [1], min_tokens=2, stop_token_ids=[3, 4]))
    outputs = {0: np.array([5], dtype=np.int64)}
    rows, tokens = state.adjustments(["a"], outputs.__getitem__).banned
    assert rows.tolist() == [0, 0, 0] and sorted(tokens.tolist()) == [3, 4, EOS]
    outputs[0] = np.array([5, 6], dtype=np.int64)
    assert state.adjustments(["a"], outputs.__getitem__) is None


def test_bad_words_ban_the_last_token_after_the_rest():
    state = _state()
    state.add_request(_new("a", [1], bad_words_token_ids=[[8], [2, 3, 4]]))
    output = {0: np.array([9, 2, 3], dtype=np.int64)}
    _, tokens = state.adjustments(["a"], output.__getitem__).banned
    assert sorted(tokens.tolist()) == [4, 8]
    output[0] = np.array([2, 9, 3], dtype=np.int64)
    _, tokens = state.adjustments(["a"], output.__getitem__).banned
    assert tokens.tolist() == [8]
