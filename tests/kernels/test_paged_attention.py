"""The unified paged-attention kernel against its torch reference, on packed mixed batches."""

from __future__ import annotations

import pytest
import torch

from kernel_inputs import DEVICE, assert_close, generator, randn
from kvpilot.kernels.paged_attention import choose_num_splits, paged_attention, paged_attention_reference


def packed_batch(requests, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """`requests` are (query tokens, context tokens) pairs; queries are each context's last tokens.

    Pages come from a shuffled pool, so no request's blocks are contiguous or in order, and
    every unused page holds random values that a wrong index would pick up.
    """
    gen = generator(seed)
    pages_per_req = [-(-seq_len // block_size) for _, seq_len in requests]
    num_blocks = sum(pages_per_req) + 4
    pool = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_tables = torch.zeros(len(requests), max(pages_per_req) + 2, dtype=torch.int32)
    for i, n in enumerate(pages_per_req):
        block_tables[i, :n] = torch.tensor(pool[:n])
        pool = pool[n:]
    q_lens = torch.tensor([q_len for q_len, _ in requests])
    query_start_loc = torch.cat((torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0))).to(torch.int32)
    return dict(
        q=randn(int(q_lens.sum()), num_heads, head_dim, gen=gen, dtype=dtype),
        key_cache=randn(num_blocks, block_size, num_kv_heads, head_dim, gen=gen, dtype=dtype),
        value_cache=randn(num_blocks, block_size, num_kv_heads, head_dim, gen=gen, dtype=dtype),
        block_tables=block_tables.to(DEVICE),
        query_start_loc=query_start_loc.to(DEVICE),
        seq_lens=torch.tensor([seq_len for _, seq_len in requests], dtype=torch.int32, device=DEVICE),
        scale=head_dim**-0.5,
    )


def check(requests, *, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32, num_splits=1, seed=0):
    inputs = packed_batch(requests, num_heads, num_kv_heads, head_dim, block_size, dtype, seed)
    out = paged_attention(**inputs, max_query_len=max(q for q, _ in requests),
                          max_seq_len=max(s for _, s in requests), num_splits=num_splits)
    assert out.dtype == dtype
    assert_close(out, paged_attention_reference(**inputs), dtype)


# Decode rows (1 query) beside prefill chunks over a cached context, a chunk that is a whole
# prompt (no context), and context lengths on and off a block boundary.
MIXED = [(1, 37), (9, 32), (1, 16), (20, 20), (5, 45), (1, 1)]


@pytest.mark.parametrize("queries_per_kv", [1, 2, 4])
def test_mixed_batch_gqa(queries_per_kv):
    check(MIXED, num_heads=2 * queries_per_kv, num_kv_heads=2, head_dim=16, block_size=4, seed=queries_per_kv)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_block_size_16_model_head_dims(head_dim, dtype):
    check([(1, 48), (7, 40), (1, 23), (12, 12)], num_heads=4, num_kv_heads=2, head_dim=head_dim,
          block_size=16, dtype=dtype, seed=head_dim)


def test_odd_group_and_head_dim_are_padded():
    # Qwen2-0.5B groups 7 query heads per KV head; head_dim 80 is not a power of two.
    check([(1, 19), (6, 30)], num_heads=7, num_kv_heads=1, head_dim=80, block_size=8)


def test_long_prefill_spans_several_query_tiles():
    check([(70, 90), (1, 33)], num_heads=2, num_kv_heads=1, head_dim=16, block_size=16, seed=3)


@pytest.mark.parametrize("num_splits", [2, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k(num_splits, dtype):
    # Contexts shorter than num_splits slices leave some splits empty; they must weigh nothing.
    check([(1, 300), (1, 5), (3, 130), (1, 256)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
          dtype=dtype, num_splits=num_splits, seed=num_splits)


def test_split_choice_follows_occupancy_and_length():
    assert choose_num_splits(num_programs=4, max_seq_len=8192, num_sms=132) == 16
    assert choose_num_splits(num_programs=64, max_seq_len=8192, num_sms=132) == 8
    assert choose_num_splits(num_programs=4, max_seq_len=1024, num_sms=132) == 4
    # A batch that fills the device, or a short context, runs in one pass.
    assert choose_num_splits(num_programs=256, max_seq_len=8192, num_sms=132) == 1
    assert choose_num_splits(num_programs=4, max_seq_len=300, num_sms=132) == 1


def test_rejects_heads_that_do_not_group():
    inputs = packed_batch([(1, 4)], 3, 2, 16, 4, torch.float32, seed=0)
    with pytest.raises(ValueError, match="do not group"):
        paged_attention(**inputs, max_query_len=1, max_seq_len=4)
