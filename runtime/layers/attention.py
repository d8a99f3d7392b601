"""Paged attention: the metadata the model runner builds, the backend interface, the torch backend.

The KV cache of one layer is a tensor `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(keys, then values). A request's KV lives in the blocks its block-table row lists; a token at
position p sits in block `block_table[p // block_size]`, offset `p % block_size`, and its flat
slot is `block_id * block_size + offset`.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.runtime.config import ATTENTION_BACKENDS

logger = logging.getLogger(__name__)


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
    # Host copies of the three above, so that a backend planning a step never waits on the device.
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
    block_tables_cpu: np.ndarray
    # What a backend derives from the rest once per step and reuses in every layer.
    backend_plan: Any = field(default=None, repr=False)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(Protocol):
    # "torch", "cpu" or "triton": the model's other layers follow it (RoPE, RMSNorm; torch's
    # unless "triton").
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


@dataclass(frozen=True)
class _QueryGroup:
    """Requests attended in one call: queries padded to `num_queries` rows, contexts to whole pages.

    Padding query rows repeat the request's last query (finite inputs, discarded outputs); padding
    keys are masked. The index tensors are built once per step on the host.
    """

    num_reqs: int
    num_queries: int
    # The padded order is the step's own token order (every token, no padding): no reordering.
    in_order: bool
    # Rows of q in padded order, [num_reqs * num_queries].
    query_rows: torch.Tensor
    # The group's real tokens (rows of q) and where each sits in the padded order.
    tokens: torch.Tensor
    padded_positions: torch.Tensor
    # Every request's pages, [num_reqs * pages_per_req]; a short request's tail is the null block.
    pages: torch.Tensor
    # Key j is visible to padded query row r of request i, [num_reqs, 1, num_queries * group, keys].
    mask: torch.Tensor


def _plan_groups(metadata: AttentionMetadata, block_size: int, group_size: int) -> list[_QueryGroup]:
    """Requests grouped by their query count rounded up to a power of two: decodes (one query)
    together, and each prefill chunk with the chunks of about its length, so that no group pads
    its queries to more than twice their number (one 512-token chunk among thirty 16-token ones,
    padded together, measured 30x the attention work)."""
    starts = metadata.query_start_loc_cpu
    query_lens = np.diff(starts)
    device = metadata.slot_mapping.device
    buckets = np.ceil(np.log2(query_lens)).astype(np.int64)
    groups = []
    for bucket in np.unique(buckets):
        members = np.flatnonzero(buckets == bucket)
        lens, seq_lens = query_lens[members], metadata.seq_lens_cpu[members]
        num_queries = int(lens.max())
        pages_per_req = int(-(-seq_lens.max() // block_size))
        offsets = np.arange(num_queries)
        query_rows = starts[members, None] + np.minimum(offsets[None, :], lens[:, None] - 1)
        real = offsets[None, :] < lens[:, None]
        padded = np.arange(len(members) * num_queries).reshape(len(members), num_queries)
        # Padded rows are ordered (query, head of the group): the queries sharing a KV head are
        # rows of one matrix, so SDPA never repeats K/V per query head.
        row_positions = (seq_lens - lens)[:, None] + np.arange(num_queries * group_size)[None, :] // group_size
        mask = np.arange(pages_per_req * block_size)[None, None, :] <= row_positions[:, :, None]
        in_order = bool(real.all()) and len(members) == len(query_lens)
        groups.append(_QueryGroup(
            num_reqs=len(members), num_queries=num_queries, in_order=in_order,
            query_rows=_to(query_rows.ravel(), device), tokens=_to(query_rows[real], device),
            padded_positions=_to(padded[real], device),
            pages=_to(metadata.block_tables_cpu[members, :pages_per_req].ravel(), device),
            mask=_to(mask[:, None], device),
        ))
    return groups


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


def _write_cache(k, v, kv_cache, slot_mapping) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes the step's K/V rows into their slots; returns the key and value caches."""
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    key_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    value_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)
    return key_cache, value_cache


class TorchPagedAttention:
    """The reference backend, batched: one SDPA call for all decodes, one per group of prefill
    chunks of similar length; no per-request loop.

    Whole pages are gathered with one `index_select` per group (a page-sized copy each, measured
    2-4x cheaper than advanced indexing); queries sharing a KV head attend as one matrix.
    bench/attention_options.py measures the alternatives.
    """

    name = "torch"

    def __init__(self) -> None:
        # The gathered pages land in buffers kept across layers and steps: a fresh tensor of a few
        # MB per layer comes as fresh pages from the OS, which measured as much CPU time as the
        # attention itself.
        self._workspace: dict[str, torch.Tensor] = {}

    def forward(self, q, k, v, kv_cache, metadata, scale):
        key_cache, value_cache = _write_cache(k, v, kv_cache, metadata.slot_mapping)
        num_heads, num_kv_heads = q.shape[1], k.shape[1]
        if metadata.backend_plan is None:
            metadata.backend_plan = _plan_groups(metadata, key_cache.shape[1], num_heads // num_kv_heads)

        groups = metadata.backend_plan
        if len(groups) == 1 and groups[0].in_order:
            return self._attend_group(q, key_cache, value_cache, groups[0], scale)
        out = torch.empty_like(q)
        for group in groups:
            attended = self._attend_group(q, key_cache, value_cache, group, scale)
            out.index_copy_(0, group.tokens, attended.index_select(0, group.padded_positions))
        return out

    def _attend_group(self, q, key_cache, value_cache, group: _QueryGroup, scale: float) -> torch.Tensor:
        """Returns the group's padded queries attended, [num_reqs * num_queries, heads, head_dim]."""
        num_reqs, num_queries = group.num_reqs, group.num_queries
        _, heads, head_dim = q.shape
        kv_heads = key_cache.shape[2]
        # [reqs, queries, kv_heads, group, dim] -> [reqs, kv_heads, queries * group, dim]
        queries = q if group.in_order else q.index_select(0, group.query_rows)
        queries = queries.reshape(num_reqs, num_queries, kv_heads, heads // kv_heads, head_dim)
        queries = queries.transpose(1, 2).reshape(num_reqs, kv_heads, -1, head_dim)
        keys, values = (self._gather(cache, group.pages, name).view(num_reqs, -1, kv_heads, head_dim).transpose(1, 2)
                        for name, cache in (("keys", key_cache), ("values", value_cache)))
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask, scale=scale)
        out = out.view(num_reqs, kv_heads, num_queries, heads // kv_heads, head_dim).transpose(1, 2)
        return out.reshape(num_reqs * num_queries, heads, head_dim)

    def _gather(self, cache: torch.Tensor, pages: torch.Tensor, name: str) -> torch.Tensor:
        """cache[pages], written into this backend's buffer for `name` (grown when too small)."""
        shape = (pages.shape[0], *cache.shape[1:])
        numel = math.prod(shape)
        buffer = self._workspace.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != cache.dtype or buffer.device != cache.device:
            buffer = self._workspace[name] = torch.empty(numel, dtype=cache.dtype, device=cache.device)
        return torch.index_select(cache, 0, pages, out=buffer[:numel].view(shape))


class CpuPagedAttention:
    """The C kernel in kvpilot.kernels.cpu: one call per layer for the whole packed step, reading
    each request's K/V through its block table where it lies (no gathered or padded copy), with
    an online softmax; the cache write is one C call for keys and values (fused_ops.c).

    bench/attention_options.py measures it against the torch backend.
    """

    name = "cpu"

    def __init__(self, kernel=None) -> None:
        """kernel: a `bind()`-ed attention entry point to run instead of this source's (a
        benchmark's baseline revision, timed through the same path)."""
        # Imported here: only an engine that runs this backend compiles the kernels.
        from kvpilot.kernels.cpu import fused_ops
        from kvpilot.kernels.cpu.paged_attention import build, paged_attention

        build()
        fused_ops.build()
        self._attend, self._write, self._kernel = paged_attention, fused_ops.kv_cache_write, kernel

    def forward(self, q, k, v, kv_cache, metadata, scale):
        key_cache, value_cache = kv_cache.unbind(0)
        self._write(k, v, key_cache, value_cache, metadata.slot_mapping)
        return self._attend(q, key_cache, value_cache, metadata.block_tables, metadata.query_start_loc,
                            metadata.seq_lens, scale, kernel=self._kernel)


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
        key_cache, value_cache = kv_cache.unbind(0)
        self._write(k, v, key_cache, value_cache, metadata.slot_mapping)
        return self._attend(q, key_cache, value_cache, metadata.block_tables, metadata.query_start_loc,
                            metadata.seq_lens, scale, metadata.max_query_len, metadata.max_seq_len)


def resolve_attention_backend(name: str, device_type: str, dtype: torch.dtype = torch.float32) -> str:
    """`auto` is Triton on CUDA, the C kernel on a CPU where it builds and supports the dtype (else
    torch, saying why), torch on any other device. Triton on a CPU only under its interpreter."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        if device_type == "cuda":
            return "triton"
        if device_type != "cpu":
            return "torch"
        reason = cpu_backend_unavailable(dtype)
        if reason is None:
            return "cpu"
        logger.warning("attention backend: torch, since the 'cpu' kernel is unavailable: %s", reason)
        return "torch"
    if name == "cpu":
        reason = (f"it runs on a CPU device only, not {device_type!r}" if device_type != "cpu"
                  else cpu_backend_unavailable(dtype))
        if reason is not None:
            raise ValueError(f"attention_backend 'cpu' is unavailable: {reason}; use 'torch'")
    if name == "triton" and device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend 'triton' on a CPU runs only under the Triton interpreter: "
                         "set TRITON_INTERPRET=1 (slow; for tests), or use 'torch'")
    return name


def cpu_backend_unavailable(dtype: torch.dtype) -> str | None:
    """Why the C kernels cannot serve a model of this dtype here, or None (they are built by now)."""
    from kvpilot.kernels.cpu import fused_ops
    from kvpilot.kernels.cpu.build import KernelBuildError
    from kvpilot.kernels.cpu.paged_attention import DTYPES, build

    if dtype not in DTYPES:
        return f"it supports {', '.join(str(d).removeprefix('torch.') for d in DTYPES)}, the model runs {dtype}"
    try:
        build()
        fused_ops.build()  # the backend's KV write, and the layers' RMSNorm, RoPE and argmax
    except KernelBuildError as error:
        return str(error)
    return None


def get_attention_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    resolved = resolve_attention_backend(name, device.type, dtype)
    if resolved == "triton":
        return TritonPagedAttention()
    if resolved == "cpu":
        return CpuPagedAttention()
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
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] (views of the fused QKV output).
        Returns [T, heads * head_dim]."""
        out = self.backend.forward(q, k, v, self.kv_cache, metadata, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)
