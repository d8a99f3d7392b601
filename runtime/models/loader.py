"""Build a model from a Hugging Face folder (config.json plus *.safetensors) or a GGUF file.

`--quantization` picks what the linear layers hold (see weight_policy): a GGUF file's packed
types as the file has them (`auto`), float weights (`none`), or a float checkpoint's matrices
quantized to int8 per output row at load (`int8`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from kvpilot.kernels.cpu.quant_matmul import PackedWeight, pack_int8
from kvpilot.runtime.config import ModelConfig
from kvpilot.runtime.layers.attention import AttentionBackend
from kvpilot.runtime.models.gguf_checkpoint import is_gguf, open_gguf
from kvpilot.runtime.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# The checkpoint matrices `int8` quantizes: the linear layers', not the embedding or LM head
# (vLLM's weight-only int8 leaves those in float too).
_INT8_MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

Weight = torch.Tensor | PackedWeight


def iterate_safetensors(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {folder!s}")
    for file in files:
        with safe_open(file, framework="pt") as tensors:
            for name in tensors.keys():
                yield name, tensors.get_tensor(name)


def iterate_gguf(config: ModelConfig, keep_packed: bool = False) -> Iterator[tuple[str, Weight]]:
    # Full tensors, one at a time: the layers keep their rank's shard of each.
    checkpoint = open_gguf(config.path)
    for name, weight in checkpoint.iterate_weights(config.num_attention_heads, config.num_key_value_heads,
                                                   keep_packed):
        yield name, weight if isinstance(weight, PackedWeight) else torch.from_numpy(weight)


def quantize_int8(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, Weight]]:
    for name, tensor in weights:
        matrix = name.rsplit(".", 2)[-2:]
        yield name, pack_int8(tensor) if matrix[1] == "weight" and matrix[0] in _INT8_MATRICES else tensor


def weight_policy(config: ModelConfig, device: torch.device) -> str:
    """`packed`, `int8` or `float`: what the linear layers will hold. The quantized matmul runs on
    the CPU, in float32; ModelConfig has refused the combinations that cannot run anywhere."""
    if config.quantization == "none":
        return "float"
    if device.type != "cpu":
        if config.quantization == "int8":
            raise ValueError(f"--quantization int8 runs on the CPU only; this engine runs on {device.type}")
        return "float"
    if config.quantization == "int8":
        return "int8"
    return "packed" if is_gguf(config.path) and config.dtype == "float32" else "float"


def iterate_weights(config: ModelConfig, policy: str = "float") -> Iterator[tuple[str, Weight]]:
    if is_gguf(config.path):
        return iterate_gguf(config, keep_packed=policy == "packed")
    weights = iterate_safetensors(config.path)
    return quantize_int8(weights) if policy == "int8" else weights


def _log_policy(config: ModelConfig, policy: str, device: torch.device) -> None:
    if is_gguf(config.path):
        packed, dequantized = open_gguf(config.path).kept_packed()
        if policy != "packed":
            dequantized, packed = packed + dequantized, []
        if packed:
            logger.info("model: weights of type %s kept packed", ", ".join(packed))
        if dequantized:
            why = ("no packed kernel for the type" if policy == "packed" else
                   "--quantization none" if config.quantization == "none" else
                   f"packed weights run on the CPU, not {device.type}" if device.type != "cpu" else
                   f"the packed kernels compute in float32, not {config.dtype}")
            logger.info("model: weights of type %s dequantized to %s at load (%s)",
                        ", ".join(dequantized), config.dtype, why)
    elif policy == "int8":
        logger.info("model: linear weights quantized to int8 per output row at load")


def load_model(config: ModelConfig, backend: AttentionBackend, device: torch.device) -> LlamaForCausalLM:
    policy = weight_policy(config, device)
    _log_policy(config, policy, device)
    # Every supported architecture is a Llama variant; ModelConfig has already refused the rest.
    with torch.device(device):
        model = LlamaForCausalLM(config, backend)
    model.load_weights(iterate_weights(config, policy))
    return model.eval()
