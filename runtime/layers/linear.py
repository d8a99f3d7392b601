"""Linear and embedding layers whose weights are split across the tensor-parallel group.

Each layer owns only its rank's shard and knows how to cut that shard out of a full checkpoint
tensor (`load`), so a checkpoint is loaded the same way at any TP size.

A checkpoint weight is a float tensor or a PackedWeight (kept quantized). A layer given packed
weights holds them in `packed` and multiplies with `quant_matmul`; its float `weight` parameter is
then emptied. Fused parts of one type (q, k and v of a Q4_1 file) become one PackedWeight, so a
decode step makes one kernel call for them; parts of different types (a Q4_K_M file's v is Q6_K
beside q and k's Q4_K) stay apart. Every linear layer computes through `matmul(x)` (no bias, no
communication), and adds the LoRA adapters' products there (`lora`), whatever the weights are.
Shards of packed weights are whole rows (column-parallel) or whole quantization blocks
(row-parallel: a boundary inside a block is a ValueError, which the model's loader names).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.kernels.cpu.quant_matmul import PackedWeight, embedding, quant_matmul
from kvpilot.runtime.distributed import all_gather_last_dim, all_reduce, tp_rank, tp_size


def _split(size: int, name: str) -> int:
    if size % tp_size():
        raise ValueError(f"{name} ({size}) is not divisible by the tensor-parallel size {tp_size()}")
    return size // tp_size()


def _owned(shard: PackedWeight) -> PackedWeight:
    """The shard in memory of its own: the rank keeps only its part, not a view of the full tensor."""
    scales = None if shard.scales is None else shard.scales.clone()
    return PackedWeight(shard.qtype, shard.rows, shard.cols, shard.data.clone(memory_format=torch.contiguous_format),
                        scales)


def _packed_matmul(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """x [..., cols] @ weight.T for float32 x (the loader keeps packed weights only in float32 models)."""
    if x.dim() == 2 and x.stride(1) == 1:  # a step's rows as the layers pass them: no reshapes
        return quant_matmul(x, weight)
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    return quant_matmul(flat, weight).reshape(*x.shape[:-1], weight.rows)


def _fused(parts: list[PackedWeight]) -> list[PackedWeight]:
    """Neighbouring parts of one type as one weight, their rows stacked in order; each in memory of
    its own (stacking copies them, a part alone is copied by `_owned`)."""
    runs: list[list[PackedWeight]] = []
    for part in parts:
        if runs and runs[-1][0].qtype == part.qtype:
            runs[-1].append(part)
        else:
            runs.append([part])
    return [_owned(run[0]) if len(run) == 1 else PackedWeight(
        run[0].qtype, sum(part.rows for part in run), run[0].cols, torch.cat([part.data for part in run]),
        None if run[0].scales is None else torch.cat([part.scales for part in run])) for run in runs]


class _PackedHolder(nn.Module):
    """The float `weight` parameter, or packed weights in its place once the checkpoint gives them."""

    # What matmul multiplies by, once every part is loaded; None for float weights.
    packed: list[PackedWeight] | None = None
    # The parts loaded so far, by fused part, while some are still to come.
    _packed_parts: list[PackedWeight | None] | None = None
    # Whether a fused part came as a float tensor: one layer's parts are all packed or all float.
    float_loaded = False
    # The layer's adapter slots (runtime/lora/device_slots.py), when the engine serves LoRA adapters.
    lora = None

    def _hold_packed(self, index: int, parts: int, shard: PackedWeight) -> None:
        if self.float_loaded:
            raise ValueError("is packed where the layer's other parts are float (--quantization none loads it)")
        if self._packed_parts is None:
            self._packed_parts = [None] * parts
            # Float storage the layer will never use: gone before the next layer loads.
            self.weight = nn.Parameter(self.weight.data.new_empty(0), requires_grad=False)
        self._packed_parts[index] = shard
        if all(part is not None for part in self._packed_parts):
            self.packed, self._packed_parts = _fused(self._packed_parts), None

    @property
    def input_features(self) -> int:
        """This rank's input width (the width `matmul` takes)."""
        return self.packed[0].cols if self.packed is not None else self.weight.shape[1]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for this rank's shard, no bias, plus each row's adapter product where it has one."""
        if self.packed is None:
            out = F.linear(x, self.weight)
        elif len(self.packed) == 1:
            out = _packed_matmul(x, self.packed[0])
        else:
            out = torch.cat([_packed_matmul(x, part) for part in self.packed], dim=-1)
        if self.lora is not None:
            self.lora.add_to(out, x)
        return out


class ColumnParallelLinear(_PackedHolder):
    """Output features split across ranks; several logical matrices (q/k/v, gate/up) may be fused.

    `output_sizes` lists the fused matrices; each is split on its own, so a rank holds
    [q_shard; k_shard; v_shard] and the activations need no communication.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.shard_sizes = [_split(size, "output size") for size in output_sizes]
        self.offsets = [sum(self.shard_sizes[:i]) for i in range(len(output_sizes))]
        total = sum(self.shard_sizes)
        self.weight = nn.Parameter(torch.empty(total, input_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(total, dtype=dtype), requires_grad=False) if bias else None

    def load(self, param_name: str, full: torch.Tensor | PackedWeight, index: int = 0) -> None:
        size = self.shard_sizes[index]
        if isinstance(full, PackedWeight):
            # Fused parts may differ in type (a Q4_K_M file's v is Q6_K beside q and k's Q4_K).
            self._hold_packed(index, len(self.shard_sizes), full.narrow_rows(tp_rank() * size, size))
            return
        if param_name == "weight":
            if self.packed is not None or self._packed_parts is not None:
                raise ValueError("is float where the layer's other parts are packed (--quantization none loads it)")
            self.float_loaded = True
        shard = full.narrow(0, tp_rank() * size, size)
        getattr(self, param_name).data.narrow(0, self.offsets[index], size).copy_(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x)
        return out if self.bias is None else out + self.bias


class RowParallelLinear(_PackedHolder):
    """Input features split across ranks; the partial products are summed with an all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.shard_size = _split(input_size, "input size")
        # Asked once: the group is formed before the model is built (and a decode step would
        # otherwise ask torch.distributed twice per layer).
        self.sharded = tp_size() > 1
        self.weight = nn.Parameter(torch.empty(output_size, self.shard_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype), requires_grad=False) if bias else None

    def load(self, param_name: str, full: torch.Tensor | PackedWeight, index: int = 0) -> None:
        if param_name == "bias":
            self.bias.data.copy_(full)
        elif isinstance(full, PackedWeight):
            try:
                shard = full.narrow_cols(tp_rank() * self.shard_size, self.shard_size)
            except ValueError as err:
                raise ValueError(f"cannot be split across {tp_size()} tensor-parallel ranks: {err}") from None
            self._hold_packed(0, 1, shard)
        else:
            self.weight.data.copy_(full.narrow(1, tp_rank() * self.shard_size, self.shard_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x)
        if self.sharded:
            out = all_reduce(out)
        # The bias is added once, after the sum, not once per rank.
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(_PackedHolder):
    """Vocabulary rows split across ranks (padded to a multiple of the TP size)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp_size())
        self.start = tp_rank() * self.shard_size
        self.sharded = tp_size() > 1
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size, dtype=dtype), requires_grad=False)

    def load(self, param_name: str, full: torch.Tensor | PackedWeight, index: int = 0) -> None:
        if isinstance(full, PackedWeight):
            # The last rank's shard is short by the padding: its padded rows are never looked up,
            # and the LM head's logits for them are cut off.
            length = min(self.shard_size, full.rows - self.start)
            self._hold_packed(0, 1, full.narrow_rows(self.start, length))
            return
        rows = full[self.start : self.start + self.shard_size]
        self.weight.data[: rows.shape[0]].copy_(rows)

    def _lookup(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.embedding(token_ids, self.weight)
        return embedding(token_ids.reshape(-1), self.packed[0]).reshape(*token_ids.shape, -1)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return self._lookup(token_ids)
        local = token_ids - self.start
        outside = (local < 0) | (local >= self.shard_size)
        out = self._lookup(local.masked_fill(outside, 0))
        return all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; shares its weight with the embedding when the checkpoint ties them."""

    def tie_to(self, embedding_layer: VocabParallelEmbedding) -> None:
        """Share the embedding's weights, float or packed (called again once they are loaded)."""
        self.weight = embedding_layer.weight
        self.packed = embedding_layer.packed

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.matmul(hidden)
        if not self.sharded:
            return out
        if self.packed is not None and out.shape[-1] < self.shard_size:
            out = F.pad(out, (0, self.shard_size - out.shape[-1]))  # the last rank's padding rows
        return all_gather_last_dim(out)[..., : self.vocab_size]
