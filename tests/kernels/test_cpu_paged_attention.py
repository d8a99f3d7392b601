"""The C paged-attention kernel (kernels/cpu/) against the dense per-request reference and the torch
backend, on packed batches of decodes and prefill chunks read through shuffled block tables."""

from __future__ import annotations

import pytest
import torch

from kernel_inputs import assert_close
from kvpilot.kernels.cpu.paged_attention import paged_attention
from kvpilot.kernels.paged_attention import paged_attention_reference
from kvpilot.runtime.layers.attention import AttentionMetadata, TorchPagedAttention
from test_paged_attention import MIXED, packed_batch

# Past one key chunk (32) and one query tile (64 rows), with decodes beside them.
LONG = [(1, 100), (40, 70), (1, 33), (17, 17), (3, 64)]


def cpu_batch(requests, num_heads, num_kv_heads, head_dim, block_size, seed=0, dtype=torch.float32):
    inputs = packed_batch(requests, num_heads, num_kv_heads, head_dim, block_size, dtype, seed)
    inputs = {name: value.cpu() if isinstance(value, torch.Tensor) else value for name, value in inputs.items()}
    for name in ("block_tables", "query_start_loc", "seq_lens"):
        inputs[name] = inputs[name].long()
    return inputs


def torch_backend(q, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale):
    """The engine's reference backend on the same inputs (no new tokens written)."""
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64), query_start_loc=query_start_loc, seq_lens=seq_lens,
        block_tables=block_tables, max_query_len=int(query_start_loc.diff().max()),
        max_seq_len=int(seq_lens.max()), query_start_loc_cpu=query_start_loc.numpy(),
        seq_lens_cpu=seq_lens.numpy(), block_tables_cpu=block_tables.numpy())
    empty = torch.empty(0, *key_cache.shape[2:], dtype=key_cache.dtype)
    return TorchPagedAttention().forward(q, empty, empty, torch.stack((key_cache, value_cache)), metadata, scale)


def check(requests, *, num_heads, num_kv_heads, head_dim, block_size, seed=0, dtype=torch.float32):
    inputs = cpu_batch(requests, num_heads, num_kv_heads, head_dim, block_size, seed, dtype)
    out = paged_attention(**inputs)
    assert out.dtype == dtype
    assert_close(out, paged_attention_reference(**inputs), dtype)
    assert_close(out, torch_backend(**inputs), dtype)
    if dtype == torch.bfloat16:
        # After its loads the bf16 path is the float32 arithmetic, so it rounds the float32
        # kernel's answer on the same (widened) values to the same bits.
        widened = {name: value.float() if value.is_floating_point() else value
                   for name, value in inputs.items() if isinstance(value, torch.Tensor)}
        assert torch.equal(out, paged_attention(**{**inputs, **widened}).bfloat16())


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("queries_per_kv", [1, 2, 4])
def test_mixed_batch_mha_and_gqa(queries_per_kv, threads):
    check(MIXED, num_heads=2 * queries_per_kv, num_kv_heads=2, head_dim=16, block_size=4, seed=queries_per_kv)


@pytest.mark.parametrize("head_dim", [16, 24, 64, 128])
def test_bfloat16_q_caches_and_out(head_dim, threads):
    """Decodes (keys dotted row by row), prefill chunks (keys transposed), head_dims of whole
    vectors and not (24: a scalar tail), across chunks and tiles."""
    check(LONG + MIXED, num_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=4, seed=head_dim,
          dtype=torch.bfloat16)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_long_contexts_across_chunks_and_tiles(block_size, head_dim, threads):
    check(LONG, num_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=block_size, seed=block_size)


def test_decodes_take_every_kv_head_in_tiles_when_the_heads_outnumber_a_tile(threads):
    """Short query runs (here MHA, so under 8 queries) are items of all 32 KV heads; at head_dim
    128 a tile holds 64 rows, so the 3- and 7-query runs split into tiles of 2 queries."""
    check([(3, 70), (1, 130), (2, 5), (7, 40), (1, 1)], num_heads=32, num_kv_heads=32, head_dim=128, block_size=16)


def test_one_kv_head_shared_by_many_heads():
    check(LONG, num_heads=16, num_kv_heads=1, head_dim=48, block_size=8)


def test_decode_only_and_padded_rows():
    """A pure-decode step padded as the engine pads one (seq_len 1 on the null block)."""
    inputs = cpu_batch([(1, 9), (1, 80), (1, 1)], 4, 2, 16, 4)
    padding = 2
    inputs["q"] = torch.cat((inputs["q"], torch.randn(padding, 4, 16)))
    inputs["query_start_loc"] = torch.cat((inputs["query_start_loc"], torch.tensor([4, 5])))
    inputs["seq_lens"] = torch.cat((inputs["seq_lens"], torch.ones(padding, dtype=torch.int64)))
    inputs["block_tables"] = torch.cat((inputs["block_tables"], torch.zeros(padding, inputs["block_tables"].shape[1],
                                                                            dtype=torch.int64)))
    assert_close(paged_attention(**inputs), paged_attention_reference(**inputs), torch.float32)


def test_strided_q_and_out_views():
    """q as a slice of a fused QKV projection, out written into a caller's buffer."""
    inputs = cpu_batch(MIXED, 4, 2, 16, 4)
    num_tokens = inputs["q"].shape[0]
    fused = torch.randn(num_tokens, 4 + 2 * 2, 16)
    fused[:, :4] = inputs["q"]
    expected = paged_attention_reference(**inputs)
    inputs["q"] = fused[:, :4]
    out = torch.full((num_tokens, 6, 16), float("nan"))[:, 1:5]
    assert paged_attention(**inputs, out=out) is out
    assert_close(out, expected, torch.float32)


def test_softmax_is_stable_for_large_scores():
    """Scores in the thousands: the running max keeps exp2 in range (no inf, no NaN). Float32 dot
    products of that size differ by ~1e-4 between summation orders, so the bound is looser."""
    inputs = cpu_batch(LONG, 8, 2, 32, 16)
    inputs["q"] *= 300
    out = paged_attention(**inputs)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, paged_attention_reference(**inputs), atol=2e-3, rtol=0)


def test_unsupported_inputs_are_refused():
    inputs = cpu_batch(MIXED, 4, 2, 16, 4)
    with pytest.raises(ValueError, match="supports"):
        paged_attention(**{**inputs, "q": inputs["q"].half()})
    with pytest.raises(ValueError, match="supports"):
        paged_attention(**{**inputs, "q": inputs["q"].bfloat16()})
    with pytest.raises(ValueError, match="do not group"):
        paged_attention(**{**inputs, "q": torch.randn(inputs["q"].shape[0], 3, 16)})
    with pytest.raises(ValueError, match="int64"):
        paged_attention(**{**inputs, "seq_lens": inputs["seq_lens"].int()})
    with pytest.raises(ValueError, match="num_reqs"):
        paged_attention(**{**inputs, "query_start_loc": inputs["query_start_loc"][:-1]})
