"""Linear and embedding layers whose weights are split across the tensor-parallel group.

Each layer owns only its rank's shard and knows how to cut that shard out of a full checkpoint
tensor (`load`), so a checkpoint is loaded the same way at any TP size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.runtime.distributed import all_gather_last_dim, all_reduce, tp_rank, tp_size


def _split(size: int, name: str) -> int:
    if size % tp_size():
        raise ValueError(f"{name} ({size}) is not divisible by the tensor-parallel size {tp_size()}")
    return size // tp_size()


class ColumnParallelLinear(nn.Module):
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

    def load(self, param_name: str, full: torch.Tensor, index: int = 0) -> None:
        size = self.shard_sizes[index]
        shard = full.narrow(0, tp_rank() * size, size)
        getattr(self, param_name).data.narrow(0, self.offsets[index], size).copy_(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input features split across ranks; the partial products are summed with an all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.shard_size = _split(input_size, "input size")
        # Asked once: the group is formed before the model is built (and a decode step would
        # otherwise ask torch.distributed twice per layer).
        self.sharded = tp_size() > 1
        self.weight = nn.Parameter(torch.empty(output_size, self.shard_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(output_size, dtype=dtype), requires_grad=False) if bias else None

    def load(self, param_name: str, full: torch.Tensor, index: int = 0) -> None:
        if param_name == "bias":
            self.bias.data.copy_(full)
            return
        self.weight.data.copy_(full.narrow(1, tp_rank() * self.shard_size, self.shard_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        if self.sharded:
            out = all_reduce(out)
        # The bias is added once, after the sum, not once per rank.
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Vocabulary rows split across ranks (padded to a multiple of the TP size)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp_size())
        self.start = tp_rank() * self.shard_size
        self.sharded = tp_size() > 1
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size, dtype=dtype), requires_grad=False)

    def load(self, param_name: str, full: torch.Tensor, index: int = 0) -> None:
        rows = full[self.start : self.start + self.shard_size]
        self.weight.data[: rows.shape[0]].copy_(rows)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; shares its weight with the embedding when the checkpoint ties them."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return F.linear(hidden, self.weight)
        return all_gather_last_dim(F.linear(hidden, self.weight))[..., : self.vocab_size]
