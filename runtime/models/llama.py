"""The Llama family (Llama, Mistral, Qwen2) over a paged KV cache.

One forward pass takes the flattened tokens of every scheduled request (no padding, no batch
dimension): `input_ids` and `positions` are [num_tokens], and the attention metadata says which
tokens belong to which request.

The forwards call their submodules' `forward` directly: `nn.Module.__call__` checks for hooks on
every call, and at decode sizes that bookkeeping (12 calls per layer per step) costs as much as a
layer's small ops. No hook is ever registered on these modules.

On the `cpu` backend, a float32 model of packed weights runs its decoder layers as one C call
when a step has few tokens (kernels/cpu/layer_stack.py): the same kernels in the same order,
without a layer's dozen Python calls in between. The layer-by-layer path is its reference.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.kernels.cpu import layer_stack
from kvpilot.kernels.cpu.quant_matmul import PackedWeight
from kvpilot.runtime.config import ModelConfig
from kvpilot.runtime.distributed import is_first_stage, is_last_stage, pp_rank, pp_size, stage_layers, tp_size
from kvpilot.runtime.layers.attention import Attention, AttentionBackend, AttentionMetadata
from kvpilot.runtime.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from kvpilot.runtime.layers.norm import RMSNorm
from kvpilot.runtime.layers.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        if config.num_key_value_heads % tp_size():
            raise ValueError(
                f"num_key_value_heads ({config.num_key_value_heads}) is not divisible by "
                f"the tensor-parallel size {tp_size()}"
            )
        head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // tp_size()
        self.num_kv_heads = config.num_key_value_heads // tp_size()
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            [config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim,
             config.num_key_value_heads * head_dim],
            bias=config.attention_bias,
            dtype=config.torch_dtype,
        )
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                        bias=False, dtype=config.torch_dtype)
        self.rotary = rotary
        self.head_dim = head_dim
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, backend)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj.forward(hidden).view(-1, heads + 2 * kv_heads, self.head_dim)
        # The query and key heads sit side by side in each row: one in-place rotation for both.
        self.rotary.forward(positions, qkv[:, : heads + kv_heads], heads)
        q, k, v = qkv.split_with_sizes([heads, kv_heads, kv_heads], dim=1)
        return self.o_proj.forward(self.attn.forward(q, k, v, metadata))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, kernels: str = "torch") -> None:
        """`kernels`: the attention backend's name, as for RMSNorm (its C activation on "cpu")."""
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=False, dtype=config.torch_dtype
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                           bias=False, dtype=config.torch_dtype)
        self._silu_and_mul = None
        if kernels == "cpu" and config.torch_dtype == torch.float32:
            from kvpilot.kernels.cpu.fused_ops import silu_and_mul

            self._silu_and_mul = silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        if self._silu_and_mul is not None:
            return self.down_proj.forward(self._silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj.forward(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, backend)
        self.mlp = LlamaMLP(config, backend.name)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.torch_dtype, backend.name)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.torch_dtype,
                                                backend.name)

    def forward(self, positions, hidden, residual, metadata):
        """Returns this layer's output and the residual stream before it; their sum is the stream after."""
        if residual is None:
            hidden, residual = self.input_layernorm.forward(hidden), hidden
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.self_attn.forward(positions, hidden, metadata)
        hidden, residual = self.post_attention_layernorm.forward(hidden, residual)
        return self.mlp.forward(hidden), residual


class LlamaForCausalLM(nn.Module):
    """The whole model, or under pipeline parallelism one stage of it: the first stage embeds the
    tokens, each runs its own decoder layers, the last normalises and holds the LM head."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.kernels = backend.name
        # The C layer stack, once built over the bound KV caches; `_stack_refused` says why it cannot be.
        self._stack = None
        self._stack_refused: str | None = None if backend.name == "cpu" else "the attention backend is not 'cpu'"
        # The attention backend brings its family's other kernels along (RoPE and the fused
        # RMSNorm: Triton's, or the C ones of the cpu backend).
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling, backend.name)
        first, last = is_first_stage(), is_last_stage()
        self.layer_range = stage_layers(config.num_hidden_layers, pp_rank(), pp_size())
        # A tied LM head is the embedding's weight: the last stage holds the embedding for it.
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, config.torch_dtype) \
            if first or (last and config.tie_word_embeddings) else None
        # Other stages' layers are placeholders, so that layer i keeps the checkpoint's number i.
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary, backend) if i in self.layer_range else nn.Identity()
            for i in range(config.num_hidden_layers)
        )
        self.own_layers = [self.layers[i] for i in self.layer_range]
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.torch_dtype, backend.name) \
            if last else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, config.torch_dtype) if last else None
        if last and config.tie_word_embeddings:
            self.lm_head.tie_to(self.embed_tokens)

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.own_layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                stream: tuple[torch.Tensor, torch.Tensor] | None = None):
        """The final hidden states, [num_tokens, hidden_size]; before the last pipeline stage, the
        residual stream to hand on instead: (hidden, residual). A stage after the first starts
        from the `stream` its predecessor handed on."""
        hidden, residual = (self.embed_tokens.forward(input_ids), None) if stream is None else stream
        stack = self._layer_stack(len(input_ids))
        if stack is not None:
            hidden, residual = stack.run(hidden, residual, positions, metadata.slot_mapping, metadata.block_tables,
                                         metadata.query_start_loc, metadata.seq_lens)
        else:
            for layer in self.own_layers:
                hidden, residual = layer.forward(positions, hidden, residual, metadata)
        if self.norm is None:
            return hidden, residual
        return self.norm.forward(hidden, residual)[0]

    def _layer_stack(self, num_tokens: int):
        """The C layer stack where it runs a step of num_tokens, else None: built on first use over
        the bound KV caches (rebuilt if they are bound anew), and refused once, with the reason
        logged, where the model cannot use it."""
        if self._stack_refused is not None or num_tokens > layer_stack.MAX_TOKENS or not self.own_layers:
            return None
        cache = self.own_layers[0].self_attn.attn.kv_cache
        if cache.numel() == 0:
            return None  # no caches bound yet
        if self._stack is None or not self._stack.serves(cache):
            self._stack_refused = self._why_no_layer_stack()
            if self._stack_refused is not None:
                logger.info("decoder layers run one by one: %s", self._stack_refused)
                return None
            self._stack = layer_stack.LayerStack(self._stack_model(), [self._stack_layer(layer)
                                                                       for layer in self.own_layers])
            logger.info("decode steps of up to %d tokens run the %d decoder layers as one C call",
                        layer_stack.MAX_TOKENS, len(self.own_layers))
        return self._stack

    def _why_no_layer_stack(self) -> str | None:
        if self.config.torch_dtype != torch.float32:
            return f"the model runs {self.config.torch_dtype}, and the C layer stack float32"
        if tp_size() > 1:
            return "tensor parallelism all-reduces between the layers' kernels"
        linears = [module for module in self.modules() if isinstance(module, (ColumnParallelLinear, RowParallelLinear))]
        if any(linear.lora is not None for linear in linears):
            return "LoRA adapters add their products between the kernels"
        if any(linear.packed is None for linear in linears):
            return "the weights are float, and the C layer stack multiplies packed ones"
        return next(filter(None, (layer_stack.why_not_stackable(self._stack_layer(layer)) for layer in self.own_layers)),
                    None)

    def _stack_model(self) -> layer_stack.StackModel:
        attention = self.own_layers[0].self_attn
        return layer_stack.StackModel(
            self.config.hidden_size, attention.num_heads, attention.num_kv_heads, attention.head_dim,
            self.config.intermediate_size, self.config.rms_norm_eps, attention.rotary.cos, attention.rotary.sin)

    @staticmethod
    def _stack_layer(layer: LlamaDecoderLayer) -> layer_stack.StackLayer:
        attention, mlp = layer.self_attn, layer.mlp
        return layer_stack.StackLayer(
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight, attention.qkv_proj.packed,
            attention.qkv_proj.bias, attention.o_proj.packed, attention.o_proj.bias, mlp.gate_up_proj.packed,
            mlp.down_proj.packed, *attention.attn.kv_cache.unbind(0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)

    def load_weights(self, weights) -> None:
        """Load (name, full tensor) pairs in Hugging Face naming; each layer keeps its own shard.
        ValueError naming the weights the model has and the checkpoint lacks."""
        # Checkpoint weights loaded, by this model's path to them before fusing (q_proj, not qkv_proj):
        # a fused layer is whole only once each of its parts is.
        loaded = set()
        shapes = _checkpoint_shapes(self.config)
        for hf_name, tensor in weights:
            if not self._holds(hf_name):
                continue  # another pipeline stage's
            target = _PARAMETER_ROUTES.get(hf_name.rsplit(".", 2)[-2], None)
            module_path, param_name = hf_name.removeprefix("model.").rsplit(".", 1)
            _check_shape(hf_name, tensor, shapes.get(module_path.rsplit(".", 1)[-1]), param_name)
            loaded.add(f"{module_path}.{param_name}")
            index = 0
            if target is not None:
                fused_name, index = target
                module_path = module_path.rsplit(".", 1)[0] + "." + fused_name
            if module_path == "lm_head" and self.config.tie_word_embeddings:
                continue
            try:
                module = self.get_submodule(module_path)
            except AttributeError:
                module = None
            # A bias the model's layer was built without (mlp_bias, say) is None there.
            if getattr(module, param_name, None) is None:
                raise ValueError(f"checkpoint has a weight this model does not: {hf_name}")
            if isinstance(tensor, torch.Tensor):
                tensor = tensor.to(self.config.torch_dtype)
            try:
                module.load(param_name, tensor, index)
            except ValueError as err:  # packed: a shard inside a block, or fused parts packed and float
                raise ValueError(f"checkpoint weight {hf_name} {err}") from None
        if self.lm_head is not None and self.config.tie_word_embeddings:
            self.lm_head.tie_to(self.embed_tokens)
        missing = [name if name.startswith("lm_head.") else f"model.{name}"
                   for name in self._unfused_parameter_names() if name not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}")

    def _holds(self, hf_name: str) -> bool:
        """Whether this stage has a place for the checkpoint weight (every name is the model's own
        or refused later); a decoder layer's weights belong to one stage."""
        parts = hf_name.removeprefix("model.").split(".")
        if parts[0] == "layers" and parts[1].isdigit():
            return int(parts[1]) in self.layer_range or int(parts[1]) >= self.config.num_hidden_layers
        return getattr(self, parts[0], True) is not None

    def _unfused_parameter_names(self) -> list[str]:
        """Every parameter's name, a fused layer's parameter once per part it is loaded from."""
        names = []
        for name, _ in self.named_parameters(remove_duplicate=True):
            module_path, param_name = name.rsplit(".", 1)
            parent, _, layer = module_path.rpartition(".")
            if layer in _FUSED_PARTS:
                names += [f"{parent}.{part}.{param_name}" for part in _FUSED_PARTS[layer]]
            else:
                names.append(name)
        return names


def _check_shape(hf_name: str, tensor: torch.Tensor | PackedWeight, weight_shape: tuple[int, ...] | None,
                 param_name: str) -> None:
    """The layers cut their shard out of the tensor they are given: one of the wrong size would load
    in part, or load too much, without a word."""
    if weight_shape is None:
        return
    expected = weight_shape if param_name == "weight" else weight_shape[:1]
    shape = (tensor.rows, tensor.cols) if isinstance(tensor, PackedWeight) else tuple(tensor.shape)
    if shape != expected:
        raise ValueError(f"checkpoint weight {hf_name} has shape {shape}, where the model's config "
                         f"implies {expected}")


def _checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each checkpoint layer's full weight shape (before any TP split), by the layer's name; a bias is
    as long as the weight's first dimension."""
    hidden, intermediate, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return {"embed_tokens": (vocab, hidden), "lm_head": (vocab, hidden), "q_proj": (q, hidden),
            "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q), "gate_proj": (intermediate, hidden),
            "up_proj": (intermediate, hidden), "down_proj": (hidden, intermediate), "input_layernorm": (hidden,),
            "post_attention_layernorm": (hidden,), "norm": (hidden,)}


# Checkpoint matrices that live inside a fused layer: name -> (fused layer, index of the part).
_PARAMETER_ROUTES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# Fused layer -> the checkpoint matrices it is made of, in order.
_FUSED_PARTS = {fused: [part for part, (name, _) in _PARAMETER_ROUTES.items() if name == fused]
                for fused, _ in _PARAMETER_ROUTES.values()}
