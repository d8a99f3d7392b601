"""reshape_and_cache against its torch reference: new K/V land in their slots, padding writes nothing."""

from __future__ import annotations

import pytest
import torch

from kernel_inputs import DEVICE, generator, randn
from kvpilot.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_reference


@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size"), [(2, 16, 4), (3, 80, 16), (8, 128, 16)])
@pytest.mark.parametrize(("dtype", "cache_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                     (torch.float32, torch.float16)])
def test_writes_match_reference(num_kv_heads, head_dim, block_size, dtype, cache_dtype):
    gen = generator(head_dim)
    num_tokens, num_blocks = 11, 6
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1
    key = randn(num_tokens, num_kv_heads, head_dim, gen=gen, dtype=dtype)
    value = randn(num_tokens, num_kv_heads, head_dim, gen=gen, dtype=dtype)
    # One tensor per layer holds keys then values, as the model runner allocates it.
    cache = randn(2, num_blocks, block_size, num_kv_heads, head_dim, gen=gen, dtype=cache_dtype)
    expected = cache.clone()
    reshape_and_cache(key, value, cache[0], cache[1], slots.to(DEVICE))
    reshape_and_cache_reference(key, value, expected[0], expected[1], slots.to(DEVICE))
    # Exact: a copy (with one rounding to the cache's dtype) has nothing to be approximate about.
    assert torch.equal(cache, expected)


def test_padding_slots_leave_the_cache_untouched():
    gen = generator(1)
    cache = randn(2, 3, 4, 1, 16, gen=gen)
    before = cache.clone()
    key = value = randn(2, 1, 16, gen=gen)
    reshape_and_cache(key, value, cache[0], cache[1], torch.tensor([-1, -1], device=DEVICE))
    assert torch.equal(cache, before)
