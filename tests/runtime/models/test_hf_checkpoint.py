"""A Hugging Face folder whose safetensors lack a weight is refused at load, naming the weight."""

from __future__ import annotations

import shutil

import pytest
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
