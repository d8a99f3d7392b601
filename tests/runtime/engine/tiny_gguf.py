"""A tiny Hugging Face checkpoint written as a llama.cpp GGUF file, each matrix in a chosen type.

The 32-weight types are quantized from the checkpoint's weights with gguf's own quantizer. gguf
cannot quantize the K-quants (its `quantize` raises NotImplementedError for Q4_K, Q5_K and Q6_K),
so those tensors get random blocks of the right layout: both sides of a parity test load the same
file, which is all parity needs. No tokenizer is written: the engine takes the tiny folder's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file

from kvpilot.kernels.cpu.quant_formats import random_blocks
from kvpilot.runtime.config import ModelConfig
from kvpilot.runtime.models.gguf_checkpoint import _LAYER_TENSORS, _MODEL_TENSORS

_K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def _gguf_name(hf_name: str) -> str:
    base, param = hf_name.rsplit(".", 1)
    for gguf_base, hf_base in _MODEL_TENSORS.items():
        if base == hf_base:
            return f"{gguf_base}.{param}"
    _, _, layer, rest = base.split(".", 3)  # model.layers.N.<hf part>
    [gguf_part] = [gg for gg, hf in _LAYER_TENSORS.items() if hf == rest]
    return f"blk.{layer}.{gguf_part}.{param}"


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (the inverse of unpermute_rotary_rows)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(hf_dir: Path, path: Path, type_of: Callable[[str], str], seed: int = 0) -> Path:
    """`type_of(gguf tensor name)` gives each 2-D tensor's GGML type name; norms stay F32."""
    config = ModelConfig.from_pretrained(hf_dir)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_vocab_size(config.vocab_size)
    generator = torch.Generator().manual_seed(seed)
    for hf_name, tensor in load_file(hf_dir / "model.safetensors").items():
        name = _gguf_name(hf_name)
        weight = tensor.float().numpy()
        if ".attn_q." in name or ".attn_k." in name:
            weight = _permute(weight, heads if ".attn_q." in name else kv_heads)
        if weight.ndim == 1:
            writer.add_tensor(name, weight)
            continue
        qtype = type_of(name)
        if qtype in _K_QUANTS:
            data = random_blocks(qtype, *weight.shape, generator).numpy()
        else:
            data = quantize(weight, GGMLQuantizationType[qtype])
        writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
