"""Build a model from a Hugging Face folder: config.json plus *.safetensors."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from kvpilot.runtime.config import ModelConfig
from kvpilot.runtime.layers.attention import AttentionBackend
from kvpilot.runtime.models.llama import LlamaForCausalLM


def iterate_safetensors(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {folder!s}")
    for file in files:
        with safe_open(file, framework="pt") as tensors:
            for name in tensors.keys():
                yield name, tensors.get_tensor(name)


def load_model(config: ModelConfig, backend: AttentionBackend, device: torch.device) -> LlamaForCausalLM:
    # Every supported architecture is a Llama variant; ModelConfig has already refused the rest.
    with torch.device(device):
        model = LlamaForCausalLM(config, backend)
    model.load_weights(iterate_safetensors(config.path))
    return model.eval()
