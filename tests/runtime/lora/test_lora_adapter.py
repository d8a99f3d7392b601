"""PEFT adapters made on the tiny checkpoint, read as the engine runs them, and every way a folder
can fail to fit the model refused with the adapter's name and the reason."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvpilot.runtime.config import ModelConfig
from kvpilot.runtime.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, LoRAAdapterError, load_adapter
from kvpilot.runtime.tiny_model import make_tiny_model

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return ModelConfig.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir, tmp_path_factory, make_peft_adapter):
    return make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("adapter") / "sql")


def test_an_adapter_reads_as_peft_wrote_it(adapter_dir, model):
    from safetensors.torch import load_file

    adapter = load_adapter("sql", adapter_dir, model, max_lora_rank=16)
    assert (adapter.name, adapter.rank, adapter.scale) == ("sql", 4, 2.0)
    assert sorted(adapter.weights) == [(layer, module) for layer in range(model.num_hidden_layers)
                                       for module in ("down_proj", "q_proj", "v_proj")]
    saved = load_file(adapter_dir / WEIGHTS_FILE)
    a, b = adapter.weights[(1, "v_proj")]
    assert torch.equal(a, saved["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"])
    assert torch.equal(b, saved["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"])
    assert b.shape == (model.num_key_value_heads * model.head_dim, 4) and b.abs().sum() > 0


def test_rslora_scales_by_the_root_of_the_rank(tiny_llama_dir, tmp_path, model, make_peft_adapter):
    folder = make_peft_adapter(tiny_llama_dir, tmp_path / "rs", r=8, lora_alpha=16, use_rslora=True)
    assert load_adapter("rs", folder, model, max_lora_rank=8).scale == pytest.approx(16 / math.sqrt(8))


def edit_config(folder, **changes):
    config = json.loads((folder / CONFIG_FILE).read_text())
    (folder / CONFIG_FILE).write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("breakage, reason", [
    (lambda d: (d / CONFIG_FILE).unlink(), "no adapter_config.json"),
    (lambda d: (d / CONFIG_FILE).write_text("{not json"), "not readable JSON"),
    (lambda d: (d / WEIGHTS_FILE).unlink(), "no adapter_model.safetensors"),
    (lambda d: (d / WEIGHTS_FILE).write_bytes((d / WEIGHTS_FILE).read_bytes()[:200]), "not readable safetensors"),
    (lambda d: edit_config(d, use_dora=True), "use_dora=True"),
    (lambda d: edit_config(d, peft_type="PREFIX_TUNING"), "not a LoRA adapter"),
    (lambda d: edit_config(d, r=8), r"is \(4, 128\); rank 8 on this model.s down_proj needs \(8, 128\)"),
])
def test_a_broken_folder_is_refused_by_name(adapter_dir, tmp_path, model, breakage, reason):
    import shutil

    folder = shutil.copytree(adapter_dir, tmp_path / "broken")
    breakage(folder)
    with pytest.raises(LoRAAdapterError, match=f"'broken'.*{reason}"):
        load_adapter("broken", folder, model, max_lora_rank=16)


def test_a_rank_above_the_limit_is_refused(adapter_dir, model):
    with pytest.raises(LoRAAdapterError, match="rank 4 is above --max-lora-rank 2"):
        load_adapter("sql", adapter_dir, model, max_lora_rank=2)


def test_targets_other_than_the_decoder_linears_are_refused(tiny_llama_dir, tmp_path, model, make_peft_adapter):
    folder = make_peft_adapter(tiny_llama_dir, tmp_path / "head", target_modules=["q_proj", "lm_head"])
    with pytest.raises(LoRAAdapterError, match="lm_head.*adapts something other than"):
        load_adapter("head", folder, model, max_lora_rank=16)


def test_an_adapter_for_another_model_shape_is_refused(tmp_path, model, make_peft_adapter):
    wider = make_tiny_model(tmp_path / "wider", hidden_size=96, num_heads=4, num_kv_heads=2)
    folder = make_peft_adapter(wider, tmp_path / "other")
    with pytest.raises(LoRAAdapterError, match="needs"):
        load_adapter("other", folder, model, max_lora_rank=16)
