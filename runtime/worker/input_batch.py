"""The persistent input batch: one row per request the runner knows, kept across steps.

Rows are host arrays (token ids, block table, sampling parameters). A step only applies what
changed: requests removed (finished or preempted), added (new or resumed), and blocks or tokens
appended; then `condense` moves rows from the tail into the holes so rows stay dense.

Under tensor parallelism every rank keeps its own batch, and the all-reduces only add up the right
partial results if all ranks put each request in the same row. So the layout is a pure function of
the SchedulerOutputs applied: a new request takes the lowest free row, which makes the result
independent even of the order in which rows were freed. `layout_fingerprint` lets the executor
check that the ranks agree.
"""

from __future__ import annotations

import heapq
import zlib

import numpy as np
import torch

from kvpilot.runtime.core.sched.output import NewRequestData
from kvpilot.runtime.layers.sampler import skip_noise


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int,
                 device: torch.device, vocab_size: int) -> None:
        """`device`: the model's, where the seeded requests' generators must live to draw the
        sampler's noise (torch refuses a CPU generator for a CUDA tensor); `vocab_size`: the width
        of each draw."""
        self.max_num_reqs = max_num_reqs
        self.device = device
        self.vocab_size = vocab_size
        self.req_ids: list[str | None] = []
        self.row_of: dict[str, int] = {}
        # Free rows below the end of `req_ids`, as a min-heap.
        self._holes: list[int] = []

        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)

        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        # The device slot of the row's LoRA adapter, -1 for none.
        self.lora_slot = np.full(max_num_reqs, -1, dtype=np.int64)
        # Keyed by request id rather than row, so moving a row never touches them.
        self.generators: dict[str, torch.Generator] = {}
        self.num_logprobs: dict[str, int] = {}
        self.num_prompt_logprobs: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.row_of)

    def add_request(self, new: NewRequestData) -> None:
        row = heapq.heappop(self._holes) if self._holes else len(self.req_ids)
        if row == len(self.req_ids):
            if row >= self.max_num_reqs:
                raise RuntimeError(f"input batch is full ({self.max_num_reqs} rows)")
            self.req_ids.append(None)
        self.req_ids[row] = new.req_id
        self.row_of[new.req_id] = row

        num_tokens = len(new.token_ids)
        self.token_ids[row, :num_tokens] = new.token_ids
        self.num_tokens[row] = num_tokens
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, new.block_ids)

        params = new.sampling_params
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.lora_slot[row] = new.lora_slot
        # A request resumed after preemption keeps its generator: its random stream goes on.
        if params.seed is not None and new.req_id not in self.generators:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
            # Output that came with the request was sampled elsewhere (a stream resumed on this
            # replica): the stream goes on after its draws, as an uninterrupted run's would.
            skip_noise(generator, num_tokens - new.num_prompt_tokens, self.vocab_size)
            self.generators[new.req_id] = generator
        if params.logprobs is not None:
            self.num_logprobs[new.req_id] = params.logprobs
        if params.prompt_logprobs is not None:
            self.num_prompt_logprobs[new.req_id] = params.prompt_logprobs

    def remove_request(self, req_id: str, preempted: bool = False) -> None:
        """Drop the request's row; a preempted request keeps its generator for when it resumes."""
        if not preempted:
            self.generators.pop(req_id, None)
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        self.req_ids[row] = None
        heapq.heappush(self._holes, row)
        self.num_logprobs.pop(req_id, None)
        self.num_prompt_logprobs.pop(req_id, None)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def output_token_ids(self, row: int) -> np.ndarray:
        return self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row]]

    def append_tokens(self, rows: np.ndarray, token_ids: list[int]) -> None:
        """One new token at the end of each of `rows` (distinct rows)."""
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def extend_tokens(self, row: int, token_ids: list[int]) -> None:
        """`token_ids` at the end of `row`."""
        start = self.num_tokens[row]
        self.token_ids[row, start : start + len(token_ids)] = token_ids
        self.num_tokens[row] += len(token_ids)

    def condense(self) -> None:
        """Fill the holes left by removed rows with the rows at the tail."""
        while self._holes:
            while self.req_ids and self.req_ids[-1] is None:
                self.req_ids.pop()
            hole = heapq.heappop(self._holes)
            if hole >= len(self.req_ids):
                # Every hole left is beyond the (trimmed) end.
                self._holes.clear()
                break
            self._move_row(len(self.req_ids) - 1, hole)

    def layout_fingerprint(self) -> int:
        """A checksum of which request sits in which row, and how far along each row is."""
        num_rows = len(self.req_ids)
        checksum = zlib.crc32("\0".join(req_id or "" for req_id in self.req_ids).encode())
        for per_row in (self.num_tokens, self.num_computed_tokens, self.num_blocks):
            checksum = zlib.crc32(per_row[:num_rows].tobytes(), checksum)
        return checksum

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self.req_ids.pop()
        self.req_ids[dst] = req_id
        self.row_of[req_id] = dst
        num_tokens, num_blocks = self.num_tokens[src], self.num_blocks[src]
        self.token_ids[dst, :num_tokens] = self.token_ids[src, :num_tokens]
        self.block_table[dst, :num_blocks] = self.block_table[src, :num_blocks]
        for per_row in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens, self.num_blocks,
                        self.temperature, self.top_k, self.top_p, self.min_p, self.lora_slot):
            per_row[dst] = per_row[src]
