"""A Hugging Face folder whose safetensors lack a weight is refused at load, naming the weight."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvpilot.runtime import LLM


@pytest.mark.parametrize("dropped", ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight",
                                     "model.layers.0.input_layernorm.weight"])
def test_a_checkpoint_without_one_weight_is_refused(tiny_llama_dir, tmp_path, dropped):
    # q, k and v load into one fused matrix (gate and up too): k alone missing must not pass for
    # the whole matrix loaded, or its rows stay whatever memory they were allocated in.
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    (shard,) = folder.glob("*.safetensors")
    tensors = load_file(shard)
    del tensors[dropped]
    save_file(tensors, shard)
    with pytest.raises(ValueError, match=f"checkpoint is missing weights: {dropped}"):
        LLM(str(folder))


@pytest.mark.parametrize("name, cut", [
    # One row too many: the rank's shard was cut out of it and the rest ignored.
    ("model.layers.0.self_attn.k_proj.weight", lambda t: torch.cat([t, t[:1]])),
    # Rows too few: the embedding loaded them and left the rest as allocated.
    ("model.embed_tokens.weight", lambda t: t[:-8]),
    ("model.layers.1.mlp.down_proj.weight", lambda t: t[:, :-1]),
], ids=["k_proj_longer", "embedding_shorter", "down_proj_narrower"])
def test_a_weight_whose_shape_disagrees_with_the_config_is_refused(tiny_llama_dir, tmp_path, name, cut):
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    (shard,) = folder.glob("*.safetensors")
    tensors = load_file(shard)
    tensors[name] = cut(tensors[name]).contiguous()
    save_file(tensors, shard)
    with pytest.raises(ValueError, match=f"checkpoint weight {name} has shape"):
        LLM(str(folder))


def test_a_bias_the_model_has_no_place_for_is_named(tiny_llama_dir, tmp_path):
    # A Llama with mlp_bias: the engine's MLP has no bias, so the weight is refused, not half-loaded.
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    (shard,) = folder.glob("*.safetensors")
    tensors = load_file(shard)
    tensors["model.layers.0.mlp.gate_proj.bias"] = torch.zeros(tensors["model.layers.0.mlp.gate_proj.weight"].shape[0])
    save_file(tensors, shard)
    with pytest.raises(ValueError, match="checkpoint has a weight this model does not: model.layers.0.mlp.gate_proj.bias"):
        LLM(str(folder))
