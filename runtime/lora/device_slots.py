"""The adapter slots on the model's device, and the per-step row -> slot index the layers read.

Each adaptable linear layer gets a LayerLoRA: per fused part (q, k, v of qkv_proj; gate, up of
gate_up_proj; o_proj and down_proj alone), A stacked as [max_loras, max_lora_rank, in] and B as
[max_loras, out, max_lora_rank], float32 whatever the base weights are (float or packed). A lower
rank is zero-padded, and a module an adapter leaves out is zero in its slot: both add nothing.

A step runs one gathered shrink and expand per part for the whole batch (kernels/lora.py): every
token carries its row's slot, -1 for the base model alone. A step where no row uses an adapter
runs no LoRA kernel at all.

Under tensor parallelism each rank holds its shard, cut as its base layer is cut: B's output rows
for column-parallel layers, A's input columns for row-parallel ones. A row-parallel rank's delta
is then a partial sum that the layer's all-reduce completes with the base product's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvpilot.kernels.cpu.build import KernelBuildError
from kvpilot.runtime.config import LoRAConfig, ModelConfig
from kvpilot.runtime.distributed import tp_rank
from kvpilot.runtime.layers.linear import ColumnParallelLinear, RowParallelLinear
from kvpilot.runtime.lora.adapter import load_adapter
from kvpilot.runtime.lora.host_cache import AdapterLRU
from kvpilot.runtime.lora.request import LoRARequest
from kvpilot.runtime.lora.slots import LoRAAssignment

# Adaptable module -> (the decoder layer's linear layer that computes it, its part in that layer).
_MODULE_PLACES = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0), "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}

LoRAKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], object]


@dataclass
class ShardedAdapter:
    """An adapter as this rank holds it in host memory: its shard of each module's A and B."""

    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class LoRABatch:
    """What every LayerLoRA reads in a step: each token's slot and each slot's scale."""

    def __init__(self, num_slots: int, device: torch.device, kernel: LoRAKernel) -> None:
        self.device = device
        self.kernel = kernel
        self.scales = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.token_slots = torch.zeros(0, dtype=torch.int64, device=device)
        self.active = False

    def set_token_slots(self, token_slots: np.ndarray) -> None:
        self.active = bool((token_slots >= 0).any())
        if self.active:
            self.token_slots = torch.from_numpy(token_slots).to(self.device, non_blocking=True)


class LayerLoRA:
    """The slots of one linear layer; `add_to` is called by the layer's matmul (linear.py)."""

    def __init__(self, batch: LoRABatch, part_sizes: list[int], in_features: int, max_rank: int) -> None:
        self.batch = batch
        slots, device = batch.scales.shape[0], batch.device
        self.offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes))]
        self.a = [torch.zeros(slots, max_rank, in_features, device=device) for _ in part_sizes]
        self.b = [torch.zeros(slots, size, max_rank, device=device) for size in part_sizes]

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Adds each token's adapter product into `out` = x @ W.T (in place)."""
        batch = self.batch
        if not batch.active:
            return
        x = x.reshape(-1, x.shape[-1])
        out = out.view(-1, out.shape[-1])
        for offset, a, b in zip(self.offsets, self.a, self.b):
            batch.kernel(out[:, offset : offset + b.shape[1]], x, a, b, batch.token_slots, batch.scales)

    def clear(self, slot: int) -> None:
        for a, b in zip(self.a, self.b):
            a[slot].zero_()
            b[slot].zero_()

    def fill(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        rank = a.shape[0]
        self.a[part][slot, :rank].copy_(a)
        self.b[part][slot, :, :rank].copy_(b)


class DeviceLoRASlots:
    """One rank's adapters: the slots on the device, and its host cache they are filled from."""

    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: LoRAConfig,
                 device: torch.device) -> None:
        self.model_config = model_config
        self.max_rank = config.max_lora_rank
        self.batch = LoRABatch(config.max_loras, device, _kernel_for(device))
        self.host_cache: AdapterLRU[ShardedAdapter] = AdapterLRU(config.max_cpu_loras or config.max_loras)
        # The id of the adapter each slot holds.
        self._slot_adapters: list[int | None] = [None] * config.max_loras
        self.layers: list[LayerLoRA] = []
        # (decoder layer index, module) -> (its LayerLoRA, its part, how this rank cuts A and B).
        self._places: dict[tuple[int, str], tuple[LayerLoRA, int, Callable]] = {}
        for index, decoder_layer in enumerate(model.layers):
            attached: dict[str, LayerLoRA] = {}
            for module, (path, part) in _MODULE_PLACES.items():
                linear = decoder_layer.get_submodule(path)
                if path not in attached:
                    # o_proj and down_proj give the hidden size; qkv_proj and gate_up_proj take it.
                    column = isinstance(linear, ColumnParallelLinear)
                    sizes = linear.shard_sizes if column else [model_config.hidden_size]
                    in_features = model_config.hidden_size if column else linear.shard_size
                    attached[path] = linear.lora = LayerLoRA(self.batch, sizes, in_features, self.max_rank)
                    self.layers.append(linear.lora)
                self._places[(index, module)] = (attached[path], part, _shard_cutter(linear, part))

    def add(self, lora: LoRARequest) -> None:
        """Loads the adapter into the host cache (LoRAAdapterError when it does not fit the model)."""
        self.host_cache.use(lora, self._load)

    def remove(self, lora_int_id: int) -> None:
        self.host_cache.remove(lora_int_id)

    def assign(self, assignment: LoRAAssignment) -> None:
        """Fills the slot with the adapter unless it holds it already, from the host cache (where the
        adapter is now the most recently used) or loaded into it again."""
        lora = assignment.lora_request
        adapter = self.host_cache.use(lora, self._load)
        slot = assignment.slot
        if self._slot_adapters[slot] == lora.lora_int_id:
            return
        self._slot_adapters[slot] = lora.lora_int_id
        for layer in self.layers:
            layer.clear(slot)
        for target, (a, b) in adapter.weights.items():
            layer, part, _ = self._places[target]
            layer.fill(slot, part, a, b)
        self.batch.scales[slot] = adapter.scale

    def _load(self, lora: LoRARequest) -> ShardedAdapter:
        adapter = load_adapter(lora.lora_name, lora.lora_path, self.model_config, self.max_rank)
        weights = {}
        for target, (a, b) in adapter.weights.items():
            cut = self._places[target][2]
            weights[target] = cut(a, b)
        return ShardedAdapter(adapter.scale, weights)


def _shard_cutter(linear: torch.nn.Module, part: int) -> Callable:
    """(A, B) of the full model -> this rank's (A, B), owned (not views of the full tensors)."""
    if isinstance(linear, ColumnParallelLinear):
        size = linear.shard_sizes[part]
        return lambda a, b: (a, b.narrow(0, tp_rank() * size, size).clone())
    size = linear.shard_size
    return lambda a, b: (a.narrow(1, tp_rank() * size, size).contiguous(), b)


def _kernel_for(device: torch.device) -> LoRAKernel:
    """The gathered LoRA product for this device: Triton on CUDA, the C kernel on a CPU (the torch
    reference where the C kernel cannot build)."""
    if device.type == "cuda":
        from kvpilot.kernels.lora import lora_apply

        return lora_apply
    from kvpilot.kernels.cpu import lora as cpu_lora

    try:
        cpu_lora.build()
        kernel = cpu_lora.lora_apply
    except KernelBuildError:
        from kvpilot.kernels.lora import lora_apply_reference as kernel

    def apply(y, x, a, b, slots, scales):
        if y.dtype == torch.float32 and x.dtype == torch.float32:
            return kernel(y, x, a, b, slots, scales)
        # A bfloat16 model: the adapter's product in float32, added once rounded.
        delta = torch.zeros(y.shape, dtype=torch.float32)
        kernel(delta, x.float(), a, b, slots, scales)
        y += delta.to(y.dtype)
        return y

    return apply
