"""Packed weights (kernels/cpu/quant_matmul.py): the torch dequantizer against gguf's numpy one,
shards along whole blocks, the C kernel at every ISA level this machine runs against
dequantize-then-matmul, and clear errors for bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from kvpilot.kernels.cpu import build, isa
from kvpilot.kernels.cpu import quant_matmul as qm
from kvpilot.kernels.cpu.build import KernelBuildError
from kvpilot.kernels.cpu.quant_formats import GGML_FORMATS, random_blocks

GGML_TYPES = sorted(GGML_FORMATS)
ALL_TYPES = sorted(qm.PACKED_TYPES)
GEMV_MAX_M = 4  # quant_matmul.c's switch-over from the decode shape to the tiled one


@pytest.fixture(scope="module", params=list(isa.LEVELS))
def level(request):
    """Every ISA level this machine runs; scalar must run everywhere, the others are skipped only
    where the CPU does not advertise them. A level the CPU advertises must build and pass its probe."""
    try:
        build._compiler()
    except KernelBuildError as error:
        pytest.skip(f"the C kernels do not build here: {error}")
    reason = isa.why_not(qm.SOURCE, request.param, qm.SELF_CHECK)
    if reason and reason.startswith("the CPU does not advertise"):
        pytest.skip(f"{request.param} does not run here: {reason}")
    assert reason is None, reason
    return request.param


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


def _assert_matches_reference(x: torch.Tensor, weight: qm.PackedWeight, level: str) -> None:
    expected = qm.reference_matmul(x, weight)
    actual = qm.quant_matmul(x, weight, isa=level)
    # Float32 accumulation in another order than torch's: bound the error by the size of the terms.
    scale = (x.abs() @ qm.dequantize(weight).abs().T).clamp_min(1.0)
    assert ((actual - expected).abs() / scale).max() < 1e-5, (actual - expected).abs().max()


@pytest.mark.parametrize("qtype", ALL_TYPES)
@pytest.mark.parametrize("num_tokens", [1, 2, GEMV_MAX_M, GEMV_MAX_M + 1, 19])
def test_the_kernel_matches_dequantize_then_matmul(level, qtype, num_tokens):
    """Decode (1..4 rows) and tiled (5, 19: partial register blocks) shapes, over 37 output rows
    (a partial tile) and three 256-column blocks."""
    weight = packed(qtype, 37, 768, seed=num_tokens)
    x = torch.randn(num_tokens, 768, generator=_gen(6))
    _assert_matches_reference(x, weight, level)


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_many_rows_dequantize_the_weight_exactly_for_torchs_gemm(level, qtype):
    """From GEMM_MIN_ROWS rows on, the C dequantizer fills a scratch that torch's GEMM reads: an
    identity x gives that scratch back bitwise, so it is exactly the reference dequantization."""
    weight = packed(qtype, 37, 256, seed=3)
    assert qm.GEMM_MIN_ROWS <= 256
    assert torch.equal(qm.quant_matmul(torch.eye(256), weight, isa=level), qm.dequantize(weight).T)
    x = torch.randn(qm.GEMM_MIN_ROWS + 3, 256, generator=_gen(7))
    _assert_matches_reference(x, weight, level)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_K", "int8"])
@pytest.mark.parametrize("num_tokens", [1, 9, 17])
def test_shards_and_strided_rows_match(level, qtype, num_tokens):
    """TP shards are views with a wider row stride; columns past one 1536-wide tile are summed in
    (17 rows: into whole register blocks too)."""
    weight = packed(qtype, 21, 2048, seed=7)
    x = torch.randn(num_tokens, 2304, generator=_gen(8))[:, :2048]  # rows 2304 floats apart
    _assert_matches_reference(x, weight.narrow_rows(5, 11), level)
    _assert_matches_reference(x[:, 256:1280].contiguous(), weight.narrow_cols(256, 1024), level)
    _assert_matches_reference(x[:, 512:].contiguous(), weight.narrow_rows(3, 1).narrow_cols(512, 1536), level)


@pytest.mark.parametrize("cols", [1, 31, 70])
def test_int8_rows_of_any_width(level, cols):
    weight = qm.pack_int8(torch.randn(13, cols, generator=_gen(cols)))
    for num_tokens in (1, 6):
        _assert_matches_reference(torch.randn(num_tokens, cols, generator=_gen(9)), weight, level)


def test_out_is_written_in_place():
    weight = packed("Q8_0", 6, 64)
    x = torch.randn(3, 64, generator=_gen(10))
    out = torch.full((3, 6), float("nan"))
    assert qm.quant_matmul(x, weight, out=out) is out
    torch.testing.assert_close(out, qm.reference_matmul(x, weight), atol=1e-4, rtol=1e-4)


def test_bad_operands_are_refused_before_the_kernel():
    weight = packed("Q4_0", 4, 64)
    with pytest.raises(ValueError, match=r"x float32 \[M, 64\].*got torch.float64"):
        qm.quant_matmul(torch.zeros(2, 64, dtype=torch.float64), weight)
    with pytest.raises(ValueError, match=r"x float32 \[M, 64\].*\[2, 32\]"):
        qm.quant_matmul(torch.zeros(2, 32), weight)
    with pytest.raises(ValueError, match="contiguous rows"):
        qm.quant_matmul(torch.zeros(64, 2).T, weight)
    with pytest.raises(ValueError, match=r"x float32 \[M, 64\]"):
        qm.quant_matmul(torch.zeros(64), weight)
    with pytest.raises(ValueError, match=r"out must be float32 \[2, 4\]"):
        qm.quant_matmul(torch.zeros(2, 64), weight, out=torch.zeros(2, 5))


def test_a_forced_isa_level_that_cannot_run_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(isa.ISA_ENV, "avx9000")
    with pytest.raises(KernelBuildError, match=r"\$KVPILOT_CPU_ISA=avx9000 cannot run on this machine: unknown ISA"):
        isa.choose(qm.SOURCE, qm.SELF_CHECK)
    with pytest.raises(KernelBuildError, match="cannot run at ISA level 'avx9000'"):
        qm.quant_matmul(torch.zeros(1, 64), packed("Q4_0", 4, 64), isa="avx9000")


def test_a_level_that_traps_is_never_chosen(monkeypatch):
    """A library whose self-check dies (as an instruction the VM traps would kill it) is reported
    with the signal, and choose() falls back to the next level."""
    monkeypatch.delenv(isa.ISA_ENV, raising=False)
    monkeypatch.setattr(isa, "_PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    isa._why_not.cache_clear()
    try:
        assert "died with SIGILL" in isa.why_not(qm.SOURCE, "scalar", qm.SELF_CHECK)
        with pytest.raises(KernelBuildError, match="no ISA level of quant_matmul.c runs here"):
            isa.choose(qm.SOURCE, qm.SELF_CHECK)
    finally:
        isa._why_not.cache_clear()
