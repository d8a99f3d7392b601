"""The Triton dequantize-matmul (kernels/dequant_matmul.py) against dequantize-then-matmul, under the
interpreter on a CPU (compiled where a GPU runs the suite)."""

from __future__ import annotations

import pytest
import torch

from kernel_inputs import DEVICE, generator, randn
from kvpilot.kernels.cpu import quant_matmul as qm
from kvpilot.kernels.cpu.quant_formats import random_blocks
from kvpilot.kernels.dequant_matmul import TYPES, dequant_matmul


def _packed(qtype: str, rows: int, cols: int, seed: int) -> qm.PackedWeight:
    if qtype == "int8":
        return qm.pack_int8(torch.randn(rows, cols, generator=generator(seed)))
    return qm.PackedWeight(qtype, rows, cols, random_blocks(qtype, rows, cols, generator(seed)))


@pytest.mark.parametrize("qtype", sorted(TYPES))
@pytest.mark.parametrize("num_tokens, rows, cols", [(1, 7, 64), (19, 33, 96)])
def test_matches_dequantize_then_matmul(qtype, num_tokens, rows, cols):
    weight = _packed(qtype, rows, cols, seed=rows)
    x = randn(num_tokens, cols, gen=generator(num_tokens))
    expected = qm.reference_matmul(x.cpu(), weight)
    torch.testing.assert_close(dequant_matmul(x, weight).cpu(), expected, atol=1e-4, rtol=1e-5)


def test_int8_rows_off_the_block_width_and_shards():
    weight = _packed("int8", 9, 45, seed=1)
    x = randn(3, 45, gen=generator(2))
    torch.testing.assert_close(dequant_matmul(x, weight).cpu(), qm.reference_matmul(x.cpu(), weight),
                               atol=1e-4, rtol=1e-5)
    shard = _packed("Q5_1", 12, 128, seed=3).narrow_rows(2, 5).narrow_cols(32, 64)
    x = randn(2, 64, gen=generator(4))
    torch.testing.assert_close(dequant_matmul(x, shard).cpu(), qm.reference_matmul(x.cpu(), shard),
                               atol=1e-4, rtol=1e-5)


def test_types_it_lacks_and_bad_x_are_refused():
    with pytest.raises(ValueError, match="takes Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, int8, not Q4_K"):
        dequant_matmul(torch.zeros(1, 256, device=DEVICE), _packed("Q4_K", 2, 256, seed=5))
    with pytest.raises(ValueError, match=r"x float32 \[M, 64\]"):
        dequant_matmul(torch.zeros(1, 32, device=DEVICE), _packed("Q8_0", 2, 64, seed=6))
