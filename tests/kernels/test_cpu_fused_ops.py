"""The C RMSNorm, rotary embedding and MLP activation (kernels/cpu/fused_ops.c) against the layers'
torch paths, and greedy generation with them against generation on the torch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvpilot.kernels.cpu import fused_ops
from kvpilot.kernels.cpu.build import KernelBuildError
from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.layers.attention import TorchPagedAttention
from kvpilot.runtime.layers.norm import RMSNorm
from kvpilot.runtime.layers.rotary import RotaryEmbedding


@pytest.fixture(scope="module", autouse=True)
def _built():
    try:
        fused_ops.build()
    except KernelBuildError as error:
        pytest.skip(f"the C kernels do not build here: {error}")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("hidden", [64, 96, 576])
def test_rms_norm_with_the_residual_add_matches_the_torch_layer(hidden):
    gen = _gen(hidden)
    # x is a strided view, as a slice of a wider projection would be.
    x = torch.randn(7, hidden + 8, generator=gen)[:, :hidden]
    residual = torch.randn(7, hidden, generator=gen)
    reference = RMSNorm(hidden, 1e-5, torch.float32)
    reference.weight.data.copy_(0.5 + torch.rand(hidden, generator=gen))
    layer = RMSNorm(hidden, 1e-5, torch.float32, "cpu")
    layer.weight.data.copy_(reference.weight)
    expected, expected_sum = reference(x.clone(), residual.clone())

    out, summed = layer(x, residual)
    assert summed is residual and torch.equal(residual, expected_sum)
    # The sum of squares is reduced in another order than torch's: equal to rounding.
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(summed), reference(expected_sum), atol=1e-5, rtol=1e-5)


def test_rms_norm_without_a_residual_leaves_its_input_alone():
    gen = _gen(1)
    x, weight = torch.randn(5, 32, generator=gen), torch.rand(32, generator=gen)
    before = x.clone()
    out = fused_ops.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, F.rms_norm(before, (32,), weight, eps=1e-6), atol=1e-6, rtol=1e-5)
    assert torch.equal(x, before)


def test_rotary_is_bitwise_the_torch_path_on_the_fused_qkv_view():
    heads, kv_heads, head_dim, tokens = 6, 2, 16, 9
    gen = _gen(2)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    expected = qkv.clone()
    RotaryEmbedding(head_dim, 64, 10000.0, None)(
        positions, expected[:, : (heads + kv_heads) * head_dim].view(tokens, -1, head_dim), heads)
    RotaryEmbedding(head_dim, 64, 10000.0, None, "cpu")(
        positions, qkv[:, : (heads + kv_heads) * head_dim].view(tokens, -1, head_dim), heads)
    # Bitwise, the values (v) beyond the rotated heads included, which stay as they were.
    assert torch.equal(qkv, expected)


@pytest.mark.parametrize("rows, width", [(1, 1536), (3, 17), (40, 2048)])
def test_silu_and_mul_matches_the_torch_mlp_activation(rows, width):
    # Gates past +-88 take expf to its limits (0 and infinity in the denominator).
    x = torch.randn(rows, 2 * width, generator=_gen(width)) * 6
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate, up = x.chunk(2, dim=-1)
    # expf and torch's vectorised exp may differ in the last bit.
    torch.testing.assert_close(fused_ops.silu_and_mul(x), F.silu(gate) * up, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="even width"):
        fused_ops.silu_and_mul(torch.randn(2, 5))


def test_bad_inputs_are_refused_before_any_write():
    rope = RotaryEmbedding(8, 16, 10000.0, None)
    x = torch.randn(3, 2, 8)
    before = x.clone()
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 16\)"):
        fused_ops.rotary_embedding(torch.tensor([0, 16, 1]), x, rope.cos, rope.sin)
    with pytest.raises(ValueError, match="float32"):
        fused_ops.rotary_embedding(torch.tensor([0, 1, 2]), x.double(), rope.cos, rope.sin)
    with pytest.raises(ValueError, match="contiguous int64"):
        fused_ops.rotary_embedding(torch.tensor([0, 1, 2], dtype=torch.int32), x, rope.cos, rope.sin)
    assert torch.equal(x, before)
    with pytest.raises(ValueError, match="shaped like x"):
        fused_ops.rms_norm(torch.randn(3, 8), torch.ones(8), 1e-6, torch.randn(2, 8))
    with pytest.raises(ValueError, match="hidden size"):
        fused_ops.rms_norm(torch.randn(3, 8), torch.ones(4), 1e-6)


def test_greedy_generation_with_the_c_kernels_matches_the_torch_path(tiny_llama_dir, monkeypatch):
    """The torch attention under the cpu backend's name: the layers around it take the C kernels."""
    prompts = [[5, 9, 12, 7, 3] * 4, list(range(10, 50)), [8] * 3]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)

    def generate():
        llm = LLM(str(tiny_llama_dir), attention_backend="torch")
        try:
            return [output.outputs[0] for output in llm.generate(prompts, params)]
        finally:
            llm.engine.shutdown()

    reference = generate()
    monkeypatch.setattr(TorchPagedAttention, "name", "cpu")
    with_kernels = generate()
    for ours, theirs in zip(with_kernels, reference):
        assert ours.token_ids == theirs.token_ids
        for token, mine, ref in zip(ours.token_ids, ours.logprobs, theirs.logprobs):
            assert mine.keys() == ref.keys()
            assert mine[token].logprob == pytest.approx(ref[token].logprob, abs=1e-4)


@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 15, 16, 17, 33, 2048, 49157])
def test_argmax_is_torch_argmax_with_ties_nans_and_infinities(vocab):
    gen = _gen(vocab)
    rows = [torch.randn(vocab, generator=gen) for _ in range(4)]
    rows.append(rows[0].round())  # many ties: the first maximum wins
    rows.append(torch.full((vocab,), float("-inf")))
    with_nans = torch.randn(vocab, generator=gen)
    with_nans[torch.rand(vocab, generator=gen) < 0.1] = float("nan")
    with_nans[-1] = float("nan")  # a NaN in the tail past the last whole vector too
    rows.append(with_nans)
    late_nan = torch.randn(vocab, generator=gen)
    late_nan[vocab // 2] = float("nan")
    rows.append(late_nan)
    logits = torch.stack(rows)
    # A strided view, as the LM head's output cut to the vocabulary is.
    padded = torch.zeros(len(rows), vocab + 3)
    padded[:, :vocab] = logits
    for x in (logits, padded[:, :vocab]):
        assert torch.equal(fused_ops.argmax(x), x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_write_is_index_copy_on_the_flat_caches(dtype):
    kv_heads, head_dim, tokens, block_size = 2, 8, 5, 4
    gen = _gen(3)
    qkv = torch.randn(tokens, (4 + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    k = qkv[:, 4 * head_dim : (4 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (4 + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    caches = torch.randn(2, 6, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    # Two rows share slot 0 (as padding requests do): the last one wins, as in index_copy_.
    slots = torch.tensor([9, 0, 23, 4, 0])
    expected = caches.clone()
    for cache, rows in zip(expected, (k, v)):
        for t, slot in enumerate(slots.tolist()):
            cache.view(-1, kv_heads, head_dim)[slot] = rows[t]
    fused_ops.kv_cache_write(k, v, caches[0], caches[1], slots)
    assert torch.equal(caches, expected)

    before = caches.clone()
    with pytest.raises(ValueError, match=r"slot_mapping must lie in \[0, 24\)"):
        fused_ops.kv_cache_write(k, v, caches[0], caches[1], torch.tensor([0, 1, 2, 24, 3]))
    with pytest.raises(ValueError, match="contiguous int64"):
        fused_ops.kv_cache_write(k, v, caches[0], caches[1], slots.int())
    with pytest.raises(ValueError, match="all float32 or all bfloat16"):
        fused_ops.kv_cache_write(k.double(), v.double(), caches[0], caches[1], slots)
    with pytest.raises(ValueError, match="all float32 or all bfloat16"):
        fused_ops.kv_cache_write(k.half(), v.half(), caches[0].half(), caches[1].half(), slots)
    assert torch.equal(caches, before)
