"""What the linear layers hold, by --quantization, checkpoint kind and device: pure choices, and
the loaded model's layers, packed where the policy says (parity lives in the engine tests)."""

from __future__ import annotations

import logging

import pytest
import torch

from kvpilot.kernels.cpu.quant_formats import random_blocks
from kvpilot.kernels.cpu.quant_matmul import PackedWeight, dequantize, from_gguf
from kvpilot.runtime import cli
from kvpilot.runtime.config import ModelConfig
from kvpilot.runtime.layers.attention import get_attention_backend
from kvpilot.runtime.layers.linear import ColumnParallelLinear
from kvpilot.runtime.models.loader import load_model, weight_policy

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("quantization, gguf, device, dtype, policy", [
    ("auto", True, CPU, "float32", "packed"),
    ("auto", True, CPU, "bfloat16", "float"),  # the packed kernels compute in float32
    ("auto", True, CUDA, "float32", "float"),  # no packed kernels wired on a GPU
    ("auto", False, CPU, "float32", "float"),
    ("none", True, CPU, "float32", "float"),
    ("int8", False, CPU, "float32", "int8"),
])
def test_the_policy(smollm2_gguf, tiny_llama_dir, quantization, gguf, device, dtype, policy):
    config = ModelConfig.from_pretrained(smollm2_gguf if gguf else tiny_llama_dir, quantization=quantization,
                                         dtype=dtype)
    assert weight_policy(config, device) == policy


def test_int8_on_a_gpu_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="--quantization int8 runs on the CPU only"):
        weight_policy(ModelConfig.from_pretrained(tiny_llama_dir, quantization="int8"), CUDA)


def test_int8_on_a_gguf_file_is_a_usage_error(smollm2_gguf, capsys):
    with pytest.raises(SystemExit) as raised:
        cli.main(["serve", str(smollm2_gguf), "--quantization", "int8"])
    assert raised.value.code == 2
    assert "--quantization int8 quantizes a float checkpoint at load; SmolLM2-135M-Instruct.Q4_1.gguf is a GGUF " \
           "file" in capsys.readouterr().err


def test_int8_with_another_dtype_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError,
                       match="--quantization int8 computes in float32; it cannot run with --dtype bfloat16"):
        ModelConfig.from_pretrained(tiny_llama_dir, quantization="int8", dtype="bfloat16")


def test_an_unknown_value_is_a_usage_error(tiny_llama_dir, capsys):
    with pytest.raises(SystemExit) as raised:
        cli.main(["serve", str(tiny_llama_dir), "--quantization", "awq"])
    assert raised.value.code == 2
    assert "--quantization" in capsys.readouterr().err


def _load(path, **settings):
    config = ModelConfig.from_pretrained(path, **settings)
    return load_model(config, get_attention_backend("torch", CPU, torch.float32), CPU)


def test_smollm2_keeps_its_file_types_packed_and_says_so(smollm2_gguf, caplog):
    with caplog.at_level(logging.INFO, logger="kvpilot.runtime.models.loader"):
        model = _load(smollm2_gguf)
    layer, embed = model.layers[0], model.embed_tokens
    # q, k and v of one type: one weight, one kernel call a step.
    [qkv] = layer.self_attn.qkv_proj.packed
    assert (qkv.qtype, qkv.rows, qkv.cols) == ("Q4_1", 960, 576)
    assert layer.mlp.down_proj.packed[0].qtype == "Q4_1"
    assert embed.packed[0].qtype == "Q8_0" and model.lm_head.packed is embed.packed  # tied
    assert layer.self_attn.qkv_proj.weight.numel() == 0  # no float copy kept beside the blocks
    assert "weights of type Q4_1, Q8_0 kept packed" in caplog.text


def test_int8_packs_only_the_linear_layers(tiny_llama_dir):
    model = _load(tiny_llama_dir, quantization="int8")
    layer, embed = model.layers[0], model.embed_tokens
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert all(isinstance(part, PackedWeight) and part.qtype == "int8" for part in linear.packed)
    assert embed.packed is None and embed.weight.dtype == torch.float32


def test_fused_parts_of_one_type_become_one_weight_and_others_stay_apart():
    """A Q4_K_M file's q and k (Q4_K) are multiplied as one weight, its v (Q6_K) on its own; the
    product is the same as the parts' side by side."""
    generator = torch.Generator().manual_seed(0)
    parts = [from_gguf(qtype, rows, 256, random_blocks(qtype, rows, 256, generator).numpy())
             for qtype, rows in (("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 32))]
    layer = ColumnParallelLinear(256, [64, 32, 32], bias=False, dtype=torch.float32)
    for index, part in enumerate(parts):
        layer.load("weight", part, index)
    assert [(weight.qtype, weight.rows) for weight in layer.packed] == [("Q4_K", 96), ("Q6_K", 32)]
    x = torch.randn(3, 256, generator=generator)
    expected = x @ torch.cat([dequantize(part) for part in parts]).T
    torch.testing.assert_close(layer.matmul(x), expected, rtol=1e-5, atol=1e-4)
