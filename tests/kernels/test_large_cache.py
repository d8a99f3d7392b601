"""A KV cache of more than 2**31 elements (an H100's worth of cache for a real model): the pages at
its end are written and read where they are, so no element offset is computed in int32.

A wrapped offset lands outside the tensor and crashes the process that reads or writes there, so
the check runs in a process of its own.
"""

from __future__ import annotations

import multiprocessing

import torch

from kernel_inputs import DEVICE, assert_close, generator, randn
from kvpilot.kernels.paged_attention import paged_attention, paged_attention_reference
from kvpilot.kernels.reshape_and_cache import reshape_and_cache

BLOCK_SIZE, KV_HEADS, HEAD_DIM = 16, 1, 16
NUM_BLOCKS = 2**31 // (BLOCK_SIZE * KV_HEADS * HEAD_DIM) + 4


def _large_cache(tmp_path) -> torch.Tensor:
    """On the host, a sparse file's mapping: 4 GiB of address space, memory only for touched pages."""
    shape, dtype = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM), torch.float16
    if DEVICE.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=DEVICE)
    numel = NUM_BLOCKS * BLOCK_SIZE * KV_HEADS * HEAD_DIM
    path = tmp_path / "cache"
    with open(path, "wb") as file:
        file.truncate(numel * dtype.itemsize)
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)


def test_pages_past_two_to_the_31_elements_are_written_and_attended(tmp_path):
    check = multiprocessing.get_context("spawn").Process(target=_write_and_attend_at_the_end, args=(tmp_path,))
    check.start()
    check.join(timeout=120)
    assert check.exitcode == 0, f"the check exited with {check.exitcode} (a negative code: killed by that signal)"


def _write_and_attend_at_the_end(tmp_path) -> None:
    cache = _large_cache(tmp_path)
    assert cache.numel() > 2**31
    gen = generator(0)
    seq_len = 40
    pages = torch.tensor([NUM_BLOCKS - 1, NUM_BLOCKS - 3, NUM_BLOCKS - 2])
    positions = torch.arange(seq_len)
    slots = (pages[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE).to(DEVICE)
    kv = randn(seq_len, KV_HEADS, HEAD_DIM, gen=gen, dtype=torch.float16)
    # One tensor for keys and values: the second 4 GiB would add nothing to the offsets checked.
    reshape_and_cache(kv, kv, cache, cache, slots)
    assert torch.equal(cache.view(-1, KV_HEADS, HEAD_DIM)[slots], kv)

    # int32 block tables and query starts, as the kernel tests use: the offsets' width comes from the kernel.
    inputs = dict(
        q=randn(3, 2, HEAD_DIM, gen=gen, dtype=torch.float16), key_cache=cache, value_cache=cache,
        block_tables=pages.repeat(2, 1).to(torch.int32).to(DEVICE),
        query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([seq_len, 30], dtype=torch.int32, device=DEVICE), scale=HEAD_DIM**-0.5,
    )
    out = paged_attention(**inputs, max_query_len=2, max_seq_len=seq_len)
    assert_close(out, paged_attention_reference(**inputs), torch.float16)
