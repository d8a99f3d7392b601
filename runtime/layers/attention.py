"""Paged attention: the metadata the model runner builds, the backend interface, the torch backend.

The KV cache of one layer is a tensor `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(keys, then values). A request's KV lives in the blocks its block-table row lists; a token at
position p sits in block `block_table[p // block_size]`, offset `p % block_size`, and its flat
slot is `block_id * block_size + offset`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.runtime.config import ATTENTION_BACKENDS


@dataclass
class AttentionMetadata:
    # Where each scheduled token's K/V is written: flat slot ids, [num_tokens].
    slot_mapping: torch.Tensor
    # Request i's query tokens are rows query_start_loc[i] : query_start_loc[i + 1], [num_reqs + 1].
    query_start_loc: torch.Tensor
    # Tokens in each request's context after this step (cached + new), [num_reqs].
    seq_lens: torch.Tensor
    # Block ids of each request, padded with 0 (the null block), [num_reqs, max_blocks].
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # Host copies, so that a backend looping over requests never waits on the device.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Requests with one query token this step (decoding), and the token rows of those queries;
    # computed once per step rather than once per layer.
    decode_reqs: torch.Tensor
    decode_tokens: torch.Tensor
    # The other requests (prefill chunks), by index.
    prefill_reqs: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(Protocol):
    # "torch" or "triton": the model's other layers follow it (RoPE, RMSNorm).
    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]. Writes k, v into the cache,
        then attends each request's queries over its whole context. Returns [T, heads, head_dim]."""
        ...


class TorchPagedAttention:
    """The reference backend: gathers each request's context through its block table.

    Requests decoding one token go through one batched, padded call; each prefill chunk gets
    its own causal call, since padding queries as well would waste more than it saves.
    """

    name = "torch"

    def forward(self, q, k, v, kv_cache, metadata, scale):
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        key_cache.view(-1, *k.shape[1:]).index_copy_(0, metadata.slot_mapping, k)
        value_cache.view(-1, *v.shape[1:]).index_copy_(0, metadata.slot_mapping, v)

        out = torch.empty_like(q)
        if len(metadata.decode_reqs):
            rows, tokens = metadata.decode_reqs, metadata.decode_tokens
            out[tokens] = _decode_attention(q[tokens], key_cache, value_cache,
                                            metadata.block_tables[rows], metadata.seq_lens[rows], scale)
        starts = metadata.query_start_loc_cpu
        block_size = key_cache.shape[1]
        for i in metadata.prefill_reqs:
            start, end, seq_len = starts[i], starts[i + 1], metadata.seq_lens_cpu[i]
            blocks = metadata.block_tables[i, : -(-seq_len // block_size)]
            keys = key_cache[blocks].flatten(0, 1)[:seq_len]
            values = value_cache[blocks].flatten(0, 1)[:seq_len]
            out[start:end] = _causal_attention(q[start:end], keys, values, scale)
        return out


def _decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale):
    """One query token per request, each over its own context, padded to the longest."""
    keys = key_cache[block_tables].flatten(1, 2)
    values = value_cache[block_tables].flatten(1, 2)
    valid = torch.arange(keys.shape[1], device=q.device)[None, :] < seq_lens[:, None]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True,
    )
    return out.squeeze(2)


def _causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """The queries are the last len(q) positions of the context."""
    num_queries, context_len = q.shape[0], keys.shape[0]
    mask = None
    if num_queries > 1:
        query_positions = torch.arange(context_len - num_queries, context_len)
        mask = torch.arange(context_len)[None, :] <= query_positions[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=True,
    )
    return out.transpose(0, 1)


class TritonPagedAttention:
    """The kernels in kvpilot.kernels: one cache write, then one launch for the whole packed batch.

    It reads only device tensors and host ints from the metadata, so nothing waits on the device.
    """

    name = "triton"

    def __init__(self) -> None:
        # Imported here: the torch backend, and every process that never attends, load no Triton.
        from kvpilot.kernels.paged_attention import paged_attention
        from kvpilot.kernels.reshape_and_cache import reshape_and_cache

        self._attend, self._write = paged_attention, reshape_and_cache

    def forward(self, q, k, v, kv_cache, metadata, scale):
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        self._write(k, v, key_cache, value_cache, metadata.slot_mapping)
        return self._attend(q, key_cache, value_cache, metadata.block_tables, metadata.query_start_loc,
                            metadata.seq_lens, scale, metadata.max_query_len, metadata.max_seq_len)


def resolve_attention_backend(name: str, device_type: str) -> str:
    """`auto` is Triton on CUDA and torch elsewhere; Triton on a CPU only under its interpreter."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        return "triton" if device_type == "cuda" else "torch"
    if name == "triton" and device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend 'triton' on a CPU runs only under the Triton interpreter: "
                         "set TRITON_INTERPRET=1 (slow; for tests), or use 'torch'")
    return name


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    if resolve_attention_backend(name, device.type) == "triton":
        return TritonPagedAttention()
    return TorchPagedAttention()


class Attention(nn.Module):
    """One layer's attention over its slice of the paged KV cache (bound by the model runner)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.backend = backend
        self.kv_cache = torch.empty(0)

    def forward(self, q, k, v, metadata: AttentionMetadata) -> torch.Tensor:
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, self.kv_cache, metadata, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)
