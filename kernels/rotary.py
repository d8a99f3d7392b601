"""Rotary position embedding, neox style (the two halves of each head rotate together), in place.

For position p and pair j < head_dim / 2: (x_j, x_{j+h}) <- (x_j c - x_{j+h} s, x_{j+h} c + x_j s)
with c, s = cos, sin of angle (p, j) from the caller's tables `[max_position, head_dim / 2]`.
The rotation is fp32; the result is stored back in q's and k's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, stride_t, stride_h, token, cos, sin, num_heads,
                  HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    offs_h = tl.arange(0, HEADS_PAD)
    offs_j = tl.arange(0, HALF_PAD)
    mask = (offs_h < num_heads)[:, None] & (offs_j < HALF)[None, :]
    first = x_ptr + token * stride_t + offs_h[:, None] * stride_h + offs_j[None, :]
    x1 = tl.load(first, mask=mask).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_table,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    offs_j = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + position * stride_table + offs_j, mask=offs_j < HALF).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + position * stride_table + offs_j, mask=offs_j < HALF).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, stride_qt, stride_qh, token, cos, sin, NUM_HEADS, HEADS_PAD, HALF, HALF_PAD)
    _rotate_heads(k_ptr, stride_kt, stride_kh, token, cos, sin, NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor) -> None:
    """q: [T, heads, head_dim], k: [T, kv_heads, head_dim], rotated in place; cos, sin: [P, head_dim / 2]."""
    num_tokens, num_heads, head_dim = q.shape
    half = head_dim // 2
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("rotary_embedding needs head_dim contiguous and cos, sin of one layout")
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=k.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_heads), KV_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
        HALF=half, HALF_PAD=triton.next_power_of_2(half),
    )


def rotary_embedding_reference(positions, q, k, cos, sin) -> None:
    c = cos[positions].float().unsqueeze(1)
    s = sin[positions].float().unsqueeze(1)
    for x in (q, k):
        x1, x2 = x.float().chunk(2, dim=-1)
        x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
