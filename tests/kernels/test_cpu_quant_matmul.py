"""Packed weights (kernels/cpu/quant_matmul.py): the torch dequantizer against gguf's numpy one,
shards along whole blocks, and clear errors for bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from kvpilot.kernels.cpu import quant_matmul as qm
from kvpilot.kernels.cpu.quant_formats import GGML_FORMATS, random_blocks

GGML_TYPES = sorted(GGML_FORMATS)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def packed(qtype: str, rows: int, cols: int, seed: int = 0) -> qm.PackedWeight:
    """A random weight of any packed type (int8 from a random float weight)."""
    if qtype == "int8":
        return qm.pack_int8(torch.randn(rows, cols, generator=_gen(seed)))
    return qm.from_gguf(qtype, rows, cols, random_blocks(qtype, rows, cols, _gen(seed)).numpy())


@pytest.mark.parametrize("qtype", GGML_TYPES)
def test_dequantize_is_bitwise_ggufs_numpy_dequantizer(qtype):
    weight = packed(qtype, 5, 512)
    expected = gguf_dequantize(weight.data.numpy(), GGMLQuantizationType[qtype])
    assert torch.equal(qm.dequantize(weight), torch.from_numpy(expected))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_blocks_quantized_by_gguf_round_trip(qtype):
    """gguf's own quantizer (which the K-quants lack): its blocks decode near the float weights."""
    weights = torch.randn(3, 96, generator=_gen(1)).numpy()
    blocks = gguf_quantize(weights, GGMLQuantizationType[qtype])
    weight = qm.from_gguf(qtype, 3, 96, blocks)
    torch.testing.assert_close(qm.dequantize(weight), torch.from_numpy(weights), atol=0.3, rtol=0)


def test_pack_int8_is_per_row_symmetric_and_within_half_a_step():
    weights = torch.randn(6, 40, generator=_gen(2)) * torch.arange(1, 7).unsqueeze(1)
    weights[3] = 0
    weight = qm.pack_int8(weights)
    assert weight.data.dtype == torch.int8 and weight.data.abs().max() == 127
    assert torch.all((qm.dequantize(weight) - weights).abs() <= weight.scales.unsqueeze(1) / 2 + 1e-6)
    assert torch.equal(qm.dequantize(weight)[3], torch.zeros(40))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K", "int8"])
def test_shards_are_the_dequantized_weights_slices(qtype):
    weight = packed(qtype, 7, 768, seed=3)
    full = qm.dequantize(weight)
    assert torch.equal(qm.dequantize(weight.narrow_rows(2, 3)), full[2:5])
    assert torch.equal(qm.dequantize(weight.narrow_cols(256, 512)), full[:, 256:768])
    assert torch.equal(qm.dequantize(weight.narrow_rows(1, 5).narrow_cols(512, 256)), full[1:6, 512:768])


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_K", "int8"])
def test_embedding_dequantizes_the_rows_asked_for(qtype):
    weight = packed(qtype, 9, 256, seed=4)
    ids = torch.tensor([8, 0, 3, 3])
    assert torch.equal(qm.embedding(ids, weight), qm.dequantize(weight)[ids])
    with pytest.raises(ValueError, match=r"lie in \[0, 9\)"):
        qm.embedding(torch.tensor([9]), weight)


def test_a_byte_count_that_does_not_match_the_shape_is_refused():
    raw = random_blocks("Q4_K", 2, 256, _gen(5)).numpy()
    with pytest.raises(ValueError, match=r"a \[2, 256\] Q4_K tensor has 288 bytes, got 287"):
        qm.from_gguf("Q4_K", 2, 256, raw.reshape(-1)[:-1])
    with pytest.raises(ValueError, match="does not hold whole blocks of 256"):
        qm.from_gguf("Q4_K", 2, 576, raw)


def test_an_unknown_type_is_refused():
    with pytest.raises(ValueError, match="'IQ2_XS' is not kept packed"):
        qm.from_gguf("IQ2_XS", 1, 256, np.zeros(66, dtype=np.uint8))
    with pytest.raises(ValueError, match="unknown packed type 'Q3_K'"):
        qm.PackedWeight("Q3_K", 1, 256, torch.zeros(1, 110, dtype=torch.uint8))


def test_a_column_shard_inside_a_block_names_the_block_size():
    weight = packed("Q4_K", 2, 512)
    with pytest.raises(ValueError, match="split its blocks of 256 columns"):
        weight.narrow_cols(128, 256)
    with pytest.raises(ValueError, match="outside the weight's 2 rows"):
        weight.narrow_rows(1, 2)
