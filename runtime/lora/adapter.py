"""A LoRA adapter as the engine runs it: read from a PEFT folder and checked against the model.

A PEFT folder holds `adapter_config.json` and `adapter_model.safetensors`, whose tensors are
named `base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight`. The engine
runs adapters on the decoder layers' linear layers only (ADAPTABLE_MODULES); anything else PEFT
can train (embeddings, the LM head, biases, DoRA, per-module ranks) is refused by name rather than
dropped, since an adapter run without part of itself gives other answers than it was trained for.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvpilot.runtime.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTABLE_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR_NAME = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# PEFT options whose non-default value changes what the adapter computes, with what kvpilot runs.
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "lora_bias": False,
                "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}, "layer_replication": None}


class LoRAAdapterError(ValueError):
    """The adapter cannot run on this model; the message names the adapter and the problem."""


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    rank: int
    # What the adapter's product is multiplied by: lora_alpha / rank (PEFT's rsLoRA: / sqrt(rank)).
    scale: float
    # (layer index, module) -> (A [rank, in], B [out, rank]), float32.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def module_shapes(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each adaptable module's (out, in) features in the full (unsharded) model."""
    q, kv = model.num_attention_heads * model.head_dim, model.num_key_value_heads * model.head_dim
    hidden, intermediate = model.hidden_size, model.intermediate_size
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden), "down_proj": (hidden, intermediate)}


def load_adapter(name: str, path: str | Path, model: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """The adapter in the PEFT folder `path`; LoRAAdapterError for one that does not fit `model`."""

    shown = str(path) if len(str(path)) <= 200 else f"{str(path)[:200]}..."

    def refuse(problem: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter {name!r} ({shown}): {problem}")

    folder = Path(path)
    try:
        return _load(name, folder, refuse, model, max_lora_rank)
    except OSError as err:  # a path too long, a folder not readable: the adapter's fault, not the engine's
        raise refuse(f"its files cannot be read: {err.strerror or err}") from None


def _load(name: str, folder: Path, refuse, model: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    config = _read_config(folder, refuse)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise refuse(f"{CONFIG_FILE} gives no valid rank and alpha (r={rank!r}, lora_alpha={alpha!r})")
    if rank > max_lora_rank:
        raise refuse(f"its rank {rank} is above --max-lora-rank {max_lora_rank}")
    for option, default in _UNSUPPORTED.items():
        if config.get(option, default) not in (default, None, {}, False):
            raise refuse(f"it sets {option}={config[option]!r}, which kvpilot does not run")
    weights = _read_weights(folder, refuse, rank, model)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoRAAdapter(name, rank, float(scale), weights)


def _read_config(folder: Path, refuse) -> dict:
    if not (folder / CONFIG_FILE).is_file():
        raise refuse(f"no {CONFIG_FILE} (a PEFT adapter folder holds it and {WEIGHTS_FILE})")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise refuse(f"{CONFIG_FILE} is not readable JSON: {err}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"{CONFIG_FILE} is not a LoRA adapter's (peft_type {config.get('peft_type')!r})"
                     if isinstance(config, dict) else f"{CONFIG_FILE} is not a JSON object")
    return config


def _read_weights(folder: Path, refuse, rank: int, model: ModelConfig) -> dict:
    from safetensors import SafetensorError, safe_open

    if not (folder / WEIGHTS_FILE).is_file():
        raise refuse(f"no {WEIGHTS_FILE}")
    shapes = module_shapes(model)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(folder / WEIGHTS_FILE, framework="pt") as tensors:
            for key in tensors.keys():
                match = _TENSOR_NAME.fullmatch(key)
                if match is None or match[2] not in ADAPTABLE_MODULES:
                    raise refuse(f"tensor {key} adapts something other than the decoder layers' "
                                 f"{', '.join(ADAPTABLE_MODULES)}")
                layer, module, half = int(match[1]), match[2], match[3]
                if layer >= model.num_hidden_layers:
                    raise refuse(f"tensor {key} is for layer {layer}; the model has {model.num_hidden_layers}")
                out_features, in_features = shapes[module]
                expected = (rank, in_features) if half == "A" else (out_features, rank)
                tensor = tensors.get_tensor(key)
                if tuple(tensor.shape) != expected:
                    raise refuse(f"tensor {key} is {tuple(tensor.shape)}; rank {rank} on this model's {module} "
                                 f"needs {expected}")
                halves.setdefault((layer, module), {})[half] = tensor.float()
    except (SafetensorError, OSError, RuntimeError) as err:
        raise refuse(f"{WEIGHTS_FILE} is not readable safetensors: {err}") from None
    if not halves:
        raise refuse(f"{WEIGHTS_FILE} holds no LoRA tensors")
    for (layer, module), pair in halves.items():
        if len(pair) != 2:
            raise refuse(f"layer {layer}'s {module} has lora_{next(iter(pair))} without its other half")
    return {target: (pair["A"], pair["B"]) for target, pair in sorted(halves.items())}
