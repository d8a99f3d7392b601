"""Neox rotary embedding, in place, against its torch reference and the model's RotaryEmbedding."""

from __future__ import annotations

import pytest
import torch

from kernel_inputs import DEVICE, assert_close, generator, randn
from kvpilot.kernels.rotary import rotary_embedding, rotary_embedding_reference
from kvpilot.runtime.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 16), (7, 1, 64), (8, 8, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_in_place_rotation(num_heads, num_kv_heads, head_dim, dtype):
    gen = generator(head_dim)
    rope = RotaryEmbedding(head_dim, max_position=64, theta=10000.0, scaling=None).to(DEVICE)
    # The model's tables repeat each angle over both halves; the kernel reads one half.
    cos, sin = rope.cos[:, : head_dim // 2], rope.sin[:, : head_dim // 2]
    positions = torch.randint(0, 64, (9,), generator=gen).to(DEVICE)
    q, k = randn(9, num_heads, head_dim, gen=gen, dtype=dtype), randn(9, num_kv_heads, head_dim, gen=gen, dtype=dtype)
    qk_model = torch.cat((q, k), dim=1).float()
    rope(positions, qk_model, num_heads)
    q_model, k_model = qk_model[:, :num_heads], qk_model[:, num_heads:]
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_reference(positions, q_ref, k_ref, cos, sin)
    rotary_embedding(positions, q, k, cos, sin)
    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)
    assert_close(q_ref, q_model, dtype)
    assert_close(k_ref, k_model, dtype)


def test_rotates_a_strided_view_of_the_fused_qkv_projection():
    # q and k are slices of one [T, q + 2 kv] projection output in the model: not contiguous per token.
    gen = generator(2)
    qkv = randn(5, (4 + 2 * 2) * 16, gen=gen)
    q, k = qkv[:, :64].view(5, 4, 16), qkv[:, 64:96].view(5, 2, 16)
    untouched = qkv[:, 96:].clone()
    rope = RotaryEmbedding(16, max_position=8, theta=10000.0, scaling=None).to(DEVICE)
    positions = torch.arange(5, device=DEVICE)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_reference(positions, q_ref, k_ref, rope.cos[:, :8], rope.sin[:, :8])
    rotary_embedding(positions, q, k, rope.cos[:, :8], rope.sin[:, :8])
    assert_close(q, q_ref, torch.float32)
    assert_close(k, k_ref, torch.float32)
    assert torch.equal(qkv[:, 96:], untouched)
