"""reshape_and_cache: write each new token's K and V into its slot of the paged cache.

`slot_mapping[t]` is `block_id * block_size + offset`; a slot of -1 marks a padding token,
which writes nothing. The copy rounds once, to the cache's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Elements one program copies (per tensor): a few tokens of a real model, many of a tiny one.
_ELEMENTS_PER_PROGRAM = 2048


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, TOKENS: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    tokens = (tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)).to(tl.int64)[:, None, None]
    slot = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    offs_h = tl.arange(0, HEADS_PAD)[None, :, None]
    offs_d = tl.arange(0, HEAD_DIM_PAD)[None, None, :]
    mask = (slot >= 0) & (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
    key = tl.load(key_ptr + tokens * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    value = tl.load(value_ptr + tokens * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    dest = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + offs_h * stride_ch + offs_d
    tl.store(key_cache_ptr + dest, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dest, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key, value: [T, kv_heads, head_dim]; key/value_cache: [num_blocks, block_size, kv_heads, head_dim]."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if key.stride(-1) != 1 or value.stride(-1) != 1 or key_cache.stride(-1) != 1:
        raise ValueError("reshape_and_cache needs head_dim contiguous")
    if key_cache.stride() != value_cache.stride():
        raise ValueError("the key and value caches need one layout")
    heads_pad, head_dim_pad = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    tokens = min(triton.next_power_of_2(max(1, num_tokens)), max(1, _ELEMENTS_PER_PROGRAM // (heads_pad * head_dim_pad)))
    _reshape_and_cache_kernel[(triton.cdiv(num_tokens, tokens),)](
        key, value, key_cache, value_cache, slot_mapping, num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, TOKENS=tokens,
        HEADS_PAD=heads_pad, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=key_cache.shape[1],
    )


def reshape_and_cache_reference(key, value, key_cache, value_cache, slot_mapping) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key_cache.view(-1, *key.shape[1:]).index_copy_(0, slots, key[keep].to(key_cache.dtype))
    value_cache.view(-1, *value.shape[1:]).index_copy_(0, slots, value[keep].to(value_cache.dtype))
