"""GGUF weights: every quantization type dequantizes as gguf's reference does, in the layout the
model expects, and llama.cpp's Q/K row order is undone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from gguf_files import write_gguf
from kvpilot.runtime.config import ModelConfig
from kvpilot.runtime.models.gguf_checkpoint import GGUFCheckpoint, supported_quantization_types, unpermute_rotary_rows
from kvpilot.runtime.models.loader import iterate_gguf

ROWS, COLS = 8, 512  # two K-quant super-blocks per row
# Types gguf can also quantize: checked against the float data they came from too.
QUANTIZABLE = {Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q5_0: 7e-2, Q.Q5_1: 7e-2, Q.Q4_0: 0.15, Q.Q4_1: 0.15}
# The rest gguf only dequantizes: random blocks, with a sane float16 scale at the byte offsets where
# the block keeps one (elsewhere a random scale may decode to inf or NaN, which must come out the same).
SCALE_OFFSETS = {
    Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q6_K: (208,), Q.TQ1_0: (52,), Q.TQ2_0: (64,),
    **{qtype: (0,) for qtype in (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ4_NL, Q.IQ4_XS)},
}
ALL_TYPES = [Q[name] for name in supported_quantization_types()]


def _random_blocks(qtype: Q, rng: np.random.Generator) -> np.ndarray:
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(ROWS, COLS // block_elems, block_bytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS.get(qtype, ()):
        blocks[:, :, offset:offset + 2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    if qtype == Q.MXFP4:
        blocks[:, :, 0] = 125  # its scale: a power-of-two exponent byte, 2**(125 - 127)
    return blocks.reshape(ROWS, -1)


def _stored(qtype: Q, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray | None]:
    """(what the file holds, the float data it was made from, if any)."""
    original = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    if qtype == Q.F32:
        return original, original
    if qtype == Q.F16:
        return original.astype(np.float16), original
    if qtype in QUANTIZABLE:
        return quantize(original, qtype), original
    return _random_blocks(qtype, rng), None


def test_the_supported_types_include_the_common_ones():
    assert {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K} <= set(ALL_TYPES)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_each_type_dequantizes_as_ggufs_reference(tmp_path, qtype):
    stored, original = _stored(qtype, np.random.default_rng(int(qtype)))
    path = write_gguf(tmp_path / "m.gguf", {"blk.0.ffn_up.weight": (stored, qtype)})
    [(name, weight)] = GGUFCheckpoint(path).iterate_weights(num_heads=1, num_kv_heads=1)
    assert name == "model.layers.0.mlp.up_proj.weight"
    assert weight.shape == (ROWS, COLS) and weight.dtype == np.float32
    reference = stored.astype(np.float32) if qtype in (Q.F32, Q.F16) else dequantize(stored, qtype)
    np.testing.assert_array_equal(weight, reference)
    assert np.abs(np.nan_to_num(weight)).max() > 0
    if original is not None or qtype in SCALE_OFFSETS or qtype == Q.MXFP4:
        assert np.isfinite(weight).all()
    if original is not None:
        # Not transposed or scrambled: the values are the ones that went in, up to the type's error.
        assert np.abs(weight - original).max() <= QUANTIZABLE.get(qtype, 1e-3) * np.abs(original).max()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_gets_full_tensors_it_casts_to_its_dtype(tmp_path, dtype):
    data = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
    path = write_gguf(tmp_path / "m.gguf", {"blk.0.ffn_up.weight": (quantize(data, Q.Q8_0), Q.Q8_0)})
    config = ModelConfig(path=str(path), architecture="LlamaForCausalLM", vocab_size=1, hidden_size=COLS,
                         intermediate_size=ROWS, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                         head_dim=COLS, max_position_embeddings=1, rms_norm_eps=1e-6, rope_theta=1e4,
                         rope_scaling=None, tie_word_embeddings=True, attention_bias=False, eos_token_ids=[],
                         dtype=dtype)
    [(_, tensor)] = iterate_gguf(config)
    expected = torch.from_numpy(dequantize(quantize(data, Q.Q8_0), Q.Q8_0))
    assert torch.equal(tensor.to(config.torch_dtype), expected.to(config.torch_dtype))


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows: each head's two halves, interleaved."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@pytest.mark.parametrize("num_heads, head_dim", [(1, 4), (3, 64), (9, 8)])
def test_the_rotary_row_permutation_round_trips(num_heads, head_dim):
    weight = np.random.default_rng(num_heads).standard_normal((num_heads * head_dim, 5)).astype(np.float32)
    permuted = _llama_cpp_permute(weight, num_heads)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_rotary_rows(permuted, num_heads), weight)
    bias = np.arange(num_heads * head_dim, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_rotary_rows(_llama_cpp_permute(bias, num_heads), num_heads), bias)


@pytest.mark.parametrize("arch, permuted", [("llama", True), ("qwen2", False)])
def test_q_and_k_rows_are_reordered_only_where_llama_cpp_permuted_them(tmp_path, arch, permuted):
    heads, kv_heads, head_dim = 3, 1, 4
    rng = np.random.default_rng(5)
    q = rng.standard_normal((heads * head_dim, 8)).astype(np.float32)
    k = rng.standard_normal((kv_heads * head_dim, 8)).astype(np.float32)
    v = rng.standard_normal((kv_heads * head_dim, 8)).astype(np.float32)
    stored = {"q": _llama_cpp_permute(q, heads), "k": _llama_cpp_permute(k, kv_heads)} if permuted else {"q": q, "k": k}
    path = write_gguf(tmp_path / "m.gguf", {"blk.0.attn_q.weight": (stored["q"], Q.F32),
                                            "blk.0.attn_k.weight": (stored["k"], Q.F32),
                                            "blk.0.attn_v.weight": (v, Q.F32)}, arch=arch)
    weights = dict(GGUFCheckpoint(path).iterate_weights(heads, kv_heads))
    np.testing.assert_array_equal(weights["model.layers.0.self_attn.q_proj.weight"], q)
    np.testing.assert_array_equal(weights["model.layers.0.self_attn.k_proj.weight"], k)
    np.testing.assert_array_equal(weights["model.layers.0.self_attn.v_proj.weight"], v)


def test_rotating_pairs_of_permuted_rows_is_rotating_halves_of_the_originals():
    """Why the permutation exists: llama.cpp's pairwise rotary on its rows equals Hugging Face's
    half-split rotary on the unpermuted rows."""
    head_dim, angle = 8, np.linspace(0.1, 0.9, 4)
    q = np.random.default_rng(0).standard_normal(head_dim)
    cos, sin = np.cos(angle), np.sin(angle)
    x1, x2 = q[: head_dim // 2], q[head_dim // 2:]
    hf = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin])
    p = _llama_cpp_permute(q[:, None], 1)[:, 0]
    pairs = np.stack([p[0::2] * cos - p[1::2] * sin, p[1::2] * cos + p[0::2] * sin], axis=1).reshape(-1)
    np.testing.assert_allclose(unpermute_rotary_rows(pairs[:, None], 1)[:, 0], hf)
