"""One step's model inputs: computed on the host from the persistent batch, then written into
buffers allocated once, so every step reuses the same memory (and a captured CUDA graph finds its
inputs where it expects them).

A pure-decode step may be padded to the next decode size (vLLM's habit: 1, 2, 4, then multiples
of 8): the padding requests each decode one token at position 0, write it into slot 0 of the null
block (never handed out, so nothing reads it unmasked) and attend only to it; their outputs are
dropped.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from kvpilot.runtime.layers.attention import AttentionMetadata
from kvpilot.runtime.worker.input_batch import InputBatch

# vLLM's largest captured decode batch by default; bigger decode steps run unpadded.
MAX_DECODE_SIZE = 512


def decode_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes decode steps are padded to: 1, 2, 4, multiples of 8, and max_num_seqs."""
    top = min(max_num_seqs, MAX_DECODE_SIZE)
    return sorted({s for s in (1, 2, 4) if s < top} | set(range(8, top, 8)) | {top})


@dataclass(frozen=True)
class StepInputs:
    """Flattened inputs of one step, in batch-row order, computed with vectorised host arrays.

    Per request (in `req_ids` order): rows, starts, seq_lens, query_start_loc (one more entry).
    Per scheduled token: positions, input_ids, slot_mapping.
    """

    req_ids: list[str]
    rows: np.ndarray
    # Tokens already in the KV cache before this step.
    starts: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    positions: np.ndarray
    input_ids: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    max_query_len: int

    @classmethod
    def build(cls, batch: InputBatch, num_scheduled: dict[str, int], block_size: int) -> "StepInputs":
        """`batch` is condensed (no empty rows) and holds every scheduled request."""
        if len(num_scheduled) == len(batch.req_ids):
            # Every row is scheduled (the usual decode step): no search for the rows.
            req_ids = list(batch.req_ids)
            rows = np.arange(len(req_ids))
        else:
            req_ids = [r for r in batch.req_ids if r in num_scheduled]
            rows = np.fromiter(map(batch.row_of.__getitem__, req_ids), np.int64, len(req_ids))
        counts = np.fromiter(map(num_scheduled.__getitem__, req_ids), np.int64, len(req_ids))
        starts = batch.num_computed_tokens[rows]
        seq_lens = starts + counts
        num_tokens = int(counts.sum())
        if num_tokens == len(req_ids):
            # One token per request: each request's token is its row's next position.
            query_start_loc = np.arange(num_tokens + 1)
            token_rows, positions = rows, starts
        else:
            query_start_loc = np.concatenate(([0], np.cumsum(counts)))
            token_rows = np.repeat(rows, counts)
            offsets = np.arange(num_tokens) - np.repeat(query_start_loc[:-1], counts)
            positions = np.repeat(starts, counts) + offsets
        block_ids = batch.block_table[token_rows, positions // block_size]
        max_blocks = int(-(-seq_lens.max() // block_size))
        return cls(
            req_ids=req_ids, rows=rows, starts=starts, seq_lens=seq_lens, query_start_loc=query_start_loc,
            positions=positions, input_ids=batch.token_ids[token_rows, positions],
            slot_mapping=block_ids * block_size + positions % block_size,
            block_tables=batch.block_table[rows, :max_blocks], max_query_len=int(counts.max()),
        )

    @classmethod
    def padding_only(cls) -> "StepInputs":
        """A decode step without requests: padded, it is all padding (what graphs are captured on)."""
        empty = np.zeros(0, dtype=np.int64)
        return cls(req_ids=[], rows=empty, starts=empty, seq_lens=empty, query_start_loc=np.zeros(1, dtype=np.int64),
                   positions=empty, input_ids=empty, slot_mapping=empty,
                   block_tables=np.zeros((0, 1), dtype=np.int64), max_query_len=1)

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    def decode_size(self, sizes: list[int]) -> int | None:
        """The padded batch size of a pure-decode step, or None (a prefill chunk, or too many)."""
        if self.max_query_len != 1 or len(self.req_ids) > sizes[-1]:
            return None
        return sizes[bisect.bisect_left(sizes, len(self.req_ids))]


class StepBuffers:
    """Every step input at its largest size, allocated once; a step fills a prefix of each.

    On a CPU the buffers are the tensors the model reads. On CUDA a pinned host copy is filled,
    then copied to the device without blocking; the next fill waits for that copy first.
    """

    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int,
                 device: torch.device) -> None:
        self.device = device
        shapes = {
            "input_ids": (max_num_tokens,), "positions": (max_num_tokens,), "slot_mapping": (max_num_tokens,),
            "query_start_loc": (max_num_reqs + 1,), "seq_lens": (max_num_reqs,),
            "block_tables": (max_num_reqs, max_blocks_per_req),
        }
        self.host = {name: torch.zeros(shape, dtype=torch.int64, pin_memory=device.type == "cuda")
                     for name, shape in shapes.items()}
        self.device_tensors = self.host if device.type == "cpu" else {
            name: torch.zeros(shape, dtype=torch.int64, device=device) for name, shape in shapes.items()}
        self._host_np = {name: tensor.numpy() for name, tensor in self.host.items()}
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def load(self, step: StepInputs, padded_reqs: int | None = None,
             full_block_tables: bool = False) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Writes the step (padded to `padded_reqs` one-token requests) and returns the model's
        inputs: input_ids, positions and the attention metadata, all views of the buffers.

        `full_block_tables` hands the attention every block-table column, so that the shapes
        depend on the padded size alone (what a captured graph needs).
        """
        if self._copied is not None:
            self._copied.synchronize()
        num_reqs = len(step.req_ids)
        padded_reqs = padded_reqs or num_reqs
        num_tokens = step.num_tokens + padded_reqs - num_reqs
        host = self._host_np
        host["input_ids"][: step.num_tokens] = step.input_ids
        host["positions"][: step.num_tokens] = step.positions
        host["slot_mapping"][: step.num_tokens] = step.slot_mapping
        host["query_start_loc"][: num_reqs + 1] = step.query_start_loc
        host["seq_lens"][:num_reqs] = step.seq_lens
        width = host["block_tables"].shape[1] if full_block_tables else step.block_tables.shape[1]
        host["block_tables"][:num_reqs, : step.block_tables.shape[1]] = step.block_tables
        if padded_reqs > num_reqs:
            for name in ("input_ids", "positions", "slot_mapping"):
                host[name][step.num_tokens : num_tokens] = 0
            host["query_start_loc"][num_reqs + 1 : padded_reqs + 1] = \
                step.num_tokens + np.arange(1, padded_reqs - num_reqs + 1)
            host["seq_lens"][num_reqs:padded_reqs] = 1
            host["block_tables"][num_reqs:padded_reqs, :width] = 0

        sizes = {"input_ids": num_tokens, "positions": num_tokens, "slot_mapping": num_tokens,
                 "query_start_loc": padded_reqs + 1, "seq_lens": padded_reqs, "block_tables": padded_reqs}
        views = {}
        for name, size in sizes.items():
            views[name] = self.device_tensors[name][:size]
            if self.device_tensors is not self.host:
                views[name].copy_(self.host[name][:size], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        seq_lens_cpu = host["seq_lens"][:padded_reqs]
        metadata = AttentionMetadata(
            slot_mapping=views["slot_mapping"], query_start_loc=views["query_start_loc"],
            seq_lens=views["seq_lens"], block_tables=views["block_tables"][:, :width],
            max_query_len=step.max_query_len, max_seq_len=int(seq_lens_cpu.max()),
            query_start_loc_cpu=host["query_start_loc"][: padded_reqs + 1],
            seq_lens_cpu=seq_lens_cpu, block_tables_cpu=host["block_tables"][:padded_reqs, :width],
        )
        return views["input_ids"], views["positions"], metadata
