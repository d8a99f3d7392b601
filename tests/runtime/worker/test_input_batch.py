"""The persistent batch keeps rows across steps, applies diffs, and stays dense."""

from __future__ import annotations

import numpy as np
import torch

from kvpilot.runtime.core.sched.output import NewRequestData
from kvpilot.runtime.request import SamplingParams
from kvpilot.runtime.worker import input_batch
from kvpilot.runtime.worker.input_batch import InputBatch
from kvpilot.runtime.worker.step_inputs import StepInputs

BLOCK_SIZE = 4


def _new(req_id: str, tokens: list[int], blocks: list[int], computed: int = 0, **params) -> NewRequestData:
    return NewRequestData(req_id=req_id, token_ids=tokens, num_prompt_tokens=len(tokens),
                          sampling_params=SamplingParams(**params), block_ids=blocks, num_computed_tokens=computed)


def _batch() -> InputBatch:
    return InputBatch(max_num_reqs=8, max_model_len=32, max_blocks_per_req=8, device=torch.device("cpu"),
                      vocab_size=64)


def test_rows_survive_and_condense_fills_holes_from_the_tail():
    batch = _batch()
    for i, name in enumerate("abcde"):
        batch.add_request(_new(name, [i + 1] * 3, [i + 1], temperature=0.1 * i))
    batch.remove_request("b")
    batch.remove_request("d")
    batch.condense()
    # e (row 4) moved into b's hole (row 1); c kept row 2; d's hole was past the new end.
    assert batch.req_ids == ["a", "e", "c"]
    assert batch.row_of == {"a": 0, "e": 1, "c": 2}
    assert batch.token_ids[1, :3].tolist() == [5, 5, 5]
    assert batch.block_table[1, :1].tolist() == [5]
    assert np.isclose(batch.temperature[1], 0.4)


def test_a_new_request_takes_a_hole_before_growing_the_batch():
    batch = _batch()
    for name in "abc":
        batch.add_request(_new(name, [1], [1]))
    batch.remove_request("a")
    batch.add_request(_new("d", [2, 2], [2], seed=5, logprobs=3))
    batch.condense()
    assert batch.req_ids == ["d", "b", "c"]
    assert set(batch.generators) == {"d"} and batch.num_logprobs == {"d": 3}
    batch.remove_request("d")
    assert not batch.generators and not batch.num_logprobs


def test_a_seeded_request_gets_its_generator_on_the_engine_device(monkeypatch):
    """The sampler draws a seeded row's noise into the logits' tensor, and torch refuses a CPU
    generator for a CUDA tensor: a seeded request on a GPU engine failed its first sampled step."""
    made_on = []

    class RecordingGenerator:  # a CUDA generator cannot be made on a machine without one
        def __init__(self, device="cpu"):
            made_on.append(torch.device(device))

        def manual_seed(self, seed):
            return self

    monkeypatch.setattr(input_batch.torch, "Generator", RecordingGenerator)
    batch = InputBatch(max_num_reqs=8, max_model_len=32, max_blocks_per_req=8, device=torch.device("cuda", 1),
                       vocab_size=64)
    batch.add_request(_new("s", [1, 2], [1], seed=7))
    assert made_on == [torch.device("cuda", 1)]


def test_step_inputs_flatten_positions_slots_and_block_tables():
    batch = _batch()
    # "p": a 6-token prompt, first chunk of 5 tokens, blocks 7 and 3.
    batch.add_request(_new("p", [10, 11, 12, 13, 14, 15], [7, 3]))
    # "d": 5 computed tokens plus one sampled, decoding position 5 (block 9, offset 1).
    batch.add_request(_new("d", [20, 21, 22, 23, 24, 25], [2, 9], computed=5))
    step = StepInputs.build(batch, {"p": 5, "d": 1}, BLOCK_SIZE)
    assert step.req_ids == ["p", "d"]
    assert step.positions.tolist() == [0, 1, 2, 3, 4, 5]
    assert step.input_ids.tolist() == [10, 11, 12, 13, 14, 25]
    assert step.slot_mapping.tolist() == [28, 29, 30, 31, 12, 37]
    assert step.query_start_loc.tolist() == [0, 5, 6]
    assert step.seq_lens.tolist() == [5, 6]
    assert step.block_tables.tolist() == [[7, 3], [2, 9]]


def test_decode_step_inputs_for_every_row_and_for_some_rows():
    """A step that decodes every row (no row search, no repeats) and one that skips a row."""
    batch = _batch()
    batch.add_request(_new("a", [1, 2, 3, 4, 5], [6, 2], computed=4))  # position 4: block 2, offset 0
    batch.add_request(_new("b", [7, 8, 9], [5], computed=2))  # position 2: block 5, offset 2
    batch.add_request(_new("c", [4] * 9, [1, 3, 8], computed=8))  # position 8: block 8, offset 0
    every = StepInputs.build(batch, {"c": 1, "a": 1, "b": 1}, BLOCK_SIZE)
    assert every.req_ids == ["a", "b", "c"] and every.rows.tolist() == [0, 1, 2]
    assert every.positions.tolist() == every.starts.tolist() == [4, 2, 8]
    assert every.input_ids.tolist() == [5, 9, 4]
    assert every.slot_mapping.tolist() == [8, 22, 32]
    assert every.query_start_loc.tolist() == [0, 1, 2, 3]
    assert every.seq_lens.tolist() == [5, 3, 9] and every.max_query_len == 1
    assert every.block_tables.tolist() == [[6, 2, 0], [5, 0, 0], [1, 3, 8]]
    # The step's req_ids are its own list: the batch's later changes do not reach them.
    assert every.req_ids is not batch.req_ids

    some = StepInputs.build(batch, {"c": 1, "a": 1}, BLOCK_SIZE)
    assert some.req_ids == ["a", "c"] and some.rows.tolist() == [0, 2]
    assert some.slot_mapping.tolist() == [8, 32]
    assert some.query_start_loc.tolist() == [0, 1, 2]
    assert some.block_tables.tolist() == [[6, 2, 0], [1, 3, 8]]


def test_the_layout_does_not_depend_on_the_order_rows_were_freed():
    """TP ranks replay the same removals; whatever order they come in, every rank ends up alike."""
    layouts = []
    for removal_order in (["b", "d", "e"], ["e", "b", "d"], ["d", "e", "b"]):
        batch = _batch()
        for i, name in enumerate("abcdef"):
            batch.add_request(_new(name, [i + 1] * 3, [i + 1]))
        for name in removal_order:
            batch.remove_request(name)
        batch.add_request(_new("g", [7] * 2, [7]))
        batch.add_request(_new("h", [8] * 2, [8]))
        batch.condense()
        layouts.append((list(batch.req_ids), batch.layout_fingerprint()))
    assert layouts[0][0] == ["a", "g", "c", "h", "f"]
    assert layouts[1:] == layouts[:1] * 2


def test_the_fingerprint_changes_with_a_row_or_its_progress():
    batch = _batch()
    batch.add_request(_new("a", [1, 2], [1]))
    batch.add_request(_new("b", [3, 4], [2]))
    base = batch.layout_fingerprint()
    batch.append_tokens(np.array([batch.row_of["b"]]), [9])
    assert batch.layout_fingerprint() != base

    swapped = _batch()
    swapped.add_request(_new("b", [3, 4], [2]))
    swapped.add_request(_new("a", [1, 2], [1]))
    assert swapped.layout_fingerprint() != base


def test_append_tokens_extends_each_row_by_one():
    batch = _batch()
    batch.add_request(_new("a", [1, 2], [1]))
    batch.add_request(_new("b", [3, 4, 5], [2]))
    rows = np.array([batch.row_of["b"], batch.row_of["a"]])
    batch.append_tokens(rows, [7, 8])
    assert batch.token_ids[batch.row_of["a"], :3].tolist() == [1, 2, 8]
    assert batch.token_ids[batch.row_of["b"], :4].tolist() == [3, 4, 5, 7]
    assert batch.num_tokens[rows].tolist() == [4, 3]
