"""Rotary position embedding, neox style (the two halves of each head rotate together), in place.

For position p and pair j < head_dim / 2: (x_j, x_{j+h}) <- (x_j c - x_{j+h} s, x_{j+h} c + x_j s)
with c, s = cos, sin of angle (p, j) from the caller's tables `[max_position, head_dim / 2]`.
The rotation is fp32; the result is stored back in q's and k's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Elements one program rotates: a token or two of a real model, many tokens of a tiny one.
_ELEMENTS_PER_PROGRAM = 4096


@triton.jit
def _rotate_heads(x_ptr, stride_t, stride_h, tokens, token_valid, cos, sin, num_heads,
                  HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """tokens: [TOKENS, 1, 1]; cos, sin: [TOKENS, 1, HALF_PAD]."""
    offs_h = tl.arange(0, HEADS_PAD)[None, :, None]
    offs_j = tl.arange(0, HALF_PAD)[None, None, :]
    mask = token_valid & (offs_h < num_heads) & (offs_j < HALF)
    first = x_ptr + tokens * stride_t + offs_h * stride_h + offs_j
    x1 = tl.load(first, mask=mask).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr, num_tokens,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_table,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, TOKENS: tl.constexpr,
    HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    tokens = (tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)).to(tl.int64)[:, None, None]
    token_valid = tokens < num_tokens
    position = tl.load(positions_ptr + tokens, mask=token_valid, other=0).to(tl.int64)
    offs_j = tl.arange(0, HALF_PAD)[None, None, :]
    table_mask = token_valid & (offs_j < HALF)
    cos = tl.load(cos_ptr + position * stride_table + offs_j, mask=table_mask).to(tl.float32)
    sin = tl.load(sin_ptr + position * stride_table + offs_j, mask=table_mask).to(tl.float32)
    _rotate_heads(q_ptr, stride_qt, stride_qh, tokens, token_valid, cos, sin, NUM_HEADS, HEADS_PAD, HALF, HALF_PAD)
    _rotate_heads(k_ptr, stride_kt, stride_kh, tokens, token_valid, cos, sin, NUM_KV_HEADS, KV_HEADS_PAD,
                  HALF, HALF_PAD)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor) -> None:
    """q: [T, heads, head_dim], k: [T, kv_heads, head_dim], rotated in place; cos, sin: [P, head_dim / 2]."""
    num_tokens, num_heads, head_dim = q.shape
    half = head_dim // 2
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("rotary_embedding needs head_dim contiguous and cos, sin of one layout")
    heads_pad, half_pad = triton.next_power_of_2(num_heads), triton.next_power_of_2(half)
    tokens = min(triton.next_power_of_2(max(1, num_tokens)), max(1, _ELEMENTS_PER_PROGRAM // (heads_pad * half_pad)))
    _rotary_kernel[(triton.cdiv(num_tokens, tokens),)](
        q, k, positions, cos, sin, num_tokens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=k.shape[1], TOKENS=tokens,
        HEADS_PAD=heads_pad, KV_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
        HALF=half, HALF_PAD=half_pad,
    )


def rotary_embedding_reference(positions, q, k, cos, sin) -> None:
    c = cos[positions].float().unsqueeze(1)
    s = sin[positions].float().unsqueeze(1)
    for x in (q, k):
        x1, x2 = x.float().chunk(2, dim=-1)
        x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
