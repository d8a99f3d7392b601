"""Unified paged attention: one launch for a packed batch of prefill chunks and decode tokens.

Request i's queries are rows `query_start_loc[i] : query_start_loc[i + 1]` of `q`; they are the
last tokens of its context of `seq_lens[i]` tokens, whose K/V (already written, the new tokens
included) live in the pages `block_tables[i]` lists. Each query attends causally: to every
earlier token of its request, cached or new, and to itself.

A program owns a tile of BLOCK_Q consecutive queries of one request times the query heads that
share one KV head (GQA), so each K/V page is loaded once per group rather than once per head.
Tiles are numbered over the whole batch without a host-side map: request i's tiles start at
`query_start_loc[i] // BLOCK_Q + i`, which bounds the grid by `num_tokens // BLOCK_Q + num_reqs`
and lets a program find its request by binary search over `query_start_loc`.

The softmax is online (running max and sum, exp2 domain). With a split-K launch each program
covers one slice of the context and leaves its unnormalised partial result, max and sum; a
second kernel merges the slices. That keeps a long-context decode at small batch from running
on a handful of programs. All arithmetic is fp32: every load is converted on arrival.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# Contexts shorter than this are not worth a second (merge) launch.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 16


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q: tl.constexpr):
    """The last request whose first tile is at or before `tile`."""
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# A batch of one request must not make `num_reqs` a compile-time constant (the loop bound changes type).
@triton.jit(do_not_specialize=["num_reqs"])
def _paged_attention_kernel(
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    num_reqs, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    stride_pt, stride_ph, stride_ps,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr, QUERIES_PER_KV_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    req = _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q)
    # Token counts fit int32 whatever the metadata's dtype; the engine's int64 metadata carried
    # through this arithmetic took 70 registers a thread at decode on sm_90, against 48.
    q_start = tl.load(query_start_loc_ptr + req).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + req + 1).to(tl.int32) - q_start
    local_tile = tile - (q_start // BLOCK_Q + req)
    if local_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    context_len = seq_len - q_len

    # Row m of the tile is query (m // QUERIES_PER_KV_PAD), head (m % QUERIES_PER_KV_PAD) of the group.
    BLOCK_M: tl.constexpr = BLOCK_Q * QUERIES_PER_KV_PAD
    offs_m = tl.arange(0, BLOCK_M)
    query = local_tile * BLOCK_Q + offs_m // QUERIES_PER_KV_PAD
    group_head = offs_m % QUERIES_PER_KV_PAD
    head = kv_head * QUERIES_PER_KV + group_head
    row_valid = (query < q_len) & (group_head < QUERIES_PER_KV)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = offs_d < HEAD_DIM
    token = q_start + query

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None] & d_valid[None, :], other=0.0,
    ).to(tl.float32)

    # The last key this tile can see (causal), then this split's slice of [0, kv_end).
    kv_end = tl.minimum(seq_len, context_len + (local_tile + 1) * BLOCK_Q)
    split_len = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    kv_lo = split * split_len
    kv_hi = tl.minimum(kv_end, kv_lo + split_len)
    query_pos = context_len + query

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    block_table = block_tables_ptr + req * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        kv_pos = start + offs_n
        kv_valid = kv_pos < kv_hi
        page = tl.load(block_table + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0).to(tl.int64)
        kv_offset = (page * stride_cb + (kv_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch)[:, None] \
            + offs_d[None, :]
        kv_mask = kv_valid[:, None] & d_valid[None, :]
        k = tl.load(key_cache_ptr + kv_offset, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(value_cache_ptr + kv_offset, mask=kv_mask, other=0.0).to(tl.float32)

        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        visible = kv_valid[None, :] & (kv_pos[None, :] <= query_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # A row that has seen no key yet keeps max -inf; shift by 0 so that exp2 gives 0, not NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp2(scores - shift[:, None])
        correction = tl.exp2(running_max - shift)
        running_sum = running_sum * correction + tl.sum(p, axis=1)
        acc = acc * correction[:, None] + tl.dot(p, v, input_precision="ieee")
        running_max = new_max

    out_mask = row_valid[:, None] & d_valid[None, :]
    if NUM_SPLITS == 1:
        out = acc / running_sum[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        partial = token * stride_pt + head * stride_ph + split * stride_ps
        tl.store(partial_out_ptr + partial[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=out_mask)
        tl.store(partial_max_ptr + partial, running_max, mask=row_valid)
        tl.store(partial_sum_ptr + partial, running_sum, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
    stride_ot, stride_oh, stride_pt, stride_ph, stride_ps,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    partial = token * stride_pt + head * stride_ph + offs_s * stride_ps
    # A split past the end of a short context saw no key: max -inf, sum 0, weight 0.
    maxes = tl.load(partial_max_ptr + partial)
    sums = tl.load(partial_sum_ptr + partial)
    overall = tl.max(maxes, axis=0)
    weights = tl.exp2(maxes - overall)
    total = tl.sum(weights * sums, axis=0)
    partial_out = tl.load(partial_out_ptr + partial[:, None] * HEAD_DIM_PAD + offs_d[None, :])
    out = tl.sum(partial_out * weights[:, None], axis=0) / total
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def choose_num_splits(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """Split the context only where the batch alone leaves most of the device idle."""
    if num_programs >= num_sms or max_seq_len < 2 * _MIN_TOKENS_PER_SPLIT:
        return 1
    by_length = max_seq_len // _MIN_TOKENS_PER_SPLIT
    by_occupancy = -(-2 * num_sms // num_programs)
    return max(1, min(_MAX_SPLITS, by_length, triton.next_power_of_2(by_occupancy)))


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, heads, head_dim]; key/value_cache: [num_blocks, block_size, kv_heads, head_dim].

    The host ints `max_query_len` and `max_seq_len` size the launch without reading the device.
    `num_splits` (a power of two) splits each context; by default it is chosen from the device's
    occupancy on CUDA, and is 1 under the interpreter, which runs programs one after another.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group onto {num_kv_heads} KV heads")
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("the key and value caches need one layout with contiguous head_dim, and q too")
    num_reqs = seq_lens.shape[0]
    queries_per_kv = num_heads // num_kv_heads
    queries_per_kv_pad = triton.next_power_of_2(queries_per_kv)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    # Decode tiles hold one query per head of the group; 16 rows is the least tl.dot multiplies.
    # The fp32 (FMA, not tensor-core) dots keep their operands in registers: the key step shrinks
    # as rows and head_dim grow.
    block_m = max(16 if max_query_len == 1 else 32, queries_per_kv_pad)
    block_q = block_m // queries_per_kv_pad
    block_n = max(16, min(64, 65536 // (block_m * head_dim_pad)))
    # ptxas, for the sm_90 build a launch gets (aligned pointers, strides divisible by 16): with
    # Triton's 4 warps and 3 stages every head_dim 64 or 128 tile spilled 250-550 bytes a thread at
    # 255 registers, holding the next key step's fp32 operands beside this one's. One stage and a
    # warp per two rows of the tile take 32-71 registers and spill nothing.
    num_warps = min(16, block_m // 2)
    num_tiles = num_tokens // block_q + num_reqs
    if num_splits is None:
        num_sms = _num_sms(q.device) if q.device.type == "cuda" else 0
        busy_tiles = min(num_tiles, num_reqs * -(-max_query_len // block_q))
        num_splits = choose_num_splits(busy_tiles * num_kv_heads, max_seq_len, num_sms) if num_sms else 1
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    out = torch.empty_like(q) if out is None else out

    if num_splits == 1:
        partial_out = partial_max = partial_sum = out  # unused: the kernel stores into `out`
        partial_strides = (0, 0, 0)
    else:
        partial_max = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
        partial_sum = torch.empty_like(partial_max)
        partial_out = torch.empty(num_tokens, num_heads, num_splits, head_dim_pad, dtype=torch.float32,
                                  device=q.device)
        partial_strides = partial_max.stride()
    _paged_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        out, partial_out, partial_max, partial_sum,
        q, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
        num_reqs, scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        *partial_strides,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        QUERIES_PER_KV=queries_per_kv, QUERIES_PER_KV_PAD=queries_per_kv_pad,
        BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        num_warps=num_warps, num_stages=1,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, partial_out, partial_max, partial_sum,
            out.stride(0), out.stride(1), *partial_strides,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=num_splits,
        )
    return out


def paged_attention_reference(q, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale):
    """The same contract, one request at a time, in fp32 with an explicit causal mask."""
    out = torch.empty_like(q)
    block_size = key_cache.shape[1]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        pages = block_tables[i, : -(-seq_len // block_size)].long()
        keys = key_cache[pages].flatten(0, 1)[:seq_len].float()
        values = value_cache[pages].flatten(0, 1)[:seq_len].float()
        query_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
        attended = F.scaled_dot_product_attention(
            q[start:end].float().transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True,
        )
        out[start:end] = attended.transpose(0, 1).to(q.dtype)
    return out
