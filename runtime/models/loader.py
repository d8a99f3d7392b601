"""Build a model from a Hugging Face folder (config.json plus *.safetensors) or a GGUF file."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from kvpilot.runtime.config import ModelConfig
from kvpilot.runtime.layers.attention import AttentionBackend
from kvpilot.runtime.models.gguf_checkpoint import is_gguf, open_gguf
from kvpilot.runtime.models.llama import LlamaForCausalLM


def iterate_safetensors(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {folder!s}")
    for file in files:
        with safe_open(file, framework="pt") as tensors:
            for name in tensors.keys():
                yield name, tensors.get_tensor(name)


def iterate_gguf(config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    # Full float32 tensors, one at a time: the layers keep their rank's shard of each.
    checkpoint = open_gguf(config.path)
    for name, weight in checkpoint.iterate_weights(config.num_attention_heads, config.num_key_value_heads):
        yield name, torch.from_numpy(weight)


def iterate_weights(config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    return iterate_gguf(config) if is_gguf(config.path) else iterate_safetensors(config.path)


def load_model(config: ModelConfig, backend: AttentionBackend, device: torch.device) -> LlamaForCausalLM:
    # Every supported architecture is a Llama variant; ModelConfig has already refused the rest.
    with torch.device(device):
        model = LlamaForCausalLM(config, backend)
    model.load_weights(iterate_weights(config))
    return model.eval()
