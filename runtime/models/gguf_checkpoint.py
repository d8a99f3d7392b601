"""A single GGUF file (llama.cpp's format) as the engine sees it: metadata, config and weights.

The file is read with `gguf`, the reader published by the llama.cpp project. Weights are either
kept packed (the types kernels/cpu/quant_matmul.py reads) or dequantized one tensor at a time to
float32 with gguf's own dequantizer, renamed to Hugging Face names, and handed to the model's
loader, which cuts each rank's shard out of them; only numpy is
needed until then, so the API-server process can read the config and tokenizer without torch.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np

if TYPE_CHECKING:
    from kvpilot.kernels.cpu.quant_matmul import PackedWeight

# general.architecture -> the engine's model class; Mistral files say "llama" too.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# The architectures whose q/k rows llama.cpp's converter reorders for its pairwise ("normal") rotary;
# qwen2 runs the half-split ("neox") rotary that Hugging Face uses, so its rows are stored as they are.
_PERMUTED_QK = ("llama",)
# Stored unquantized; every other type must be one gguf's dequantizer knows.
_PLAIN_TYPES = ("F32", "F16")

# llama.cpp tensor names -> Hugging Face names (per layer, then the rest).
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_MODEL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class GGUFError(ValueError):
    """The file is not a GGUF the engine can run; the message names the file and the problem."""


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


def supported_quantization_types() -> list[str]:
    from gguf.quants import _type_traits

    return list(_PLAIN_TYPES) + [qtype.name for qtype in _type_traits]


@functools.lru_cache(maxsize=2)
def open_gguf(path: str | Path) -> "GGUFCheckpoint":
    """One reader per file and process: building one parses every metadata array (seconds)."""
    return GGUFCheckpoint(path)


class GGUFCheckpoint:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"model: no such GGUF file: {path!s}")
        try:
            self._reader = _reader_class()(self.path)
        except GGUFError:
            raise
        except Exception as err:
            # The reader indexes straight into a memory map: a short or foreign file surfaces
            # as whatever numpy raised on the first out-of-range field.
            raise GGUFError(f"model: {path!s} is not a readable GGUF file (truncated or corrupt?): "
                            f"{type(err).__name__}: {err}") from None
        self.arch = self.metadata("general.architecture", "?")
        if self.arch not in GGUF_ARCHITECTURES:
            raise GGUFError(
                f"model: {self.path.name} has architecture {self.arch!r}, which kvpilot does not implement "
                f"(supported GGUF architectures: {', '.join(GGUF_ARCHITECTURES)})"
            )
        self._check_quantization_types()

    def metadata(self, key: str, default=None):
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def arch_metadata(self, key: str, default=None):
        return self.metadata(f"{self.arch}.{key}", default)

    def row_parallel_split_problem(self, tp_size: int) -> str | None:
        """Why `tp_size` ranks cannot split this file's packed row-parallel matrices (o_proj,
        down_proj: each rank takes a slice of the inputs) along whole quantization blocks, or None."""
        from gguf import GGML_QUANT_SIZES

        from kvpilot.kernels.cpu.quant_matmul import PACKED_TYPES

        for tensor in self._reader.tensors:
            if not tensor.name.endswith(("attn_output.weight", "ffn_down.weight")) or \
                    tensor.tensor_type.name not in PACKED_TYPES:
                continue
            block = GGML_QUANT_SIZES[tensor.tensor_type][0]
            shard = int(tensor.shape[0]) // tp_size
            if shard % block:
                return (f"{tp_size} would split {hf_tensor_name(tensor.name)} ({tensor.tensor_type.name}) into "
                        f"shards of {shard} inputs, inside its blocks of {block}; use a size whose shards hold "
                        f"whole blocks, or --quantization none")
        return None

    @property
    def tensor_names(self) -> list[str]:
        return [tensor.name for tensor in self._reader.tensors]

    def _check_quantization_types(self) -> None:
        supported = set(supported_quantization_types())
        for tensor in self._reader.tensors:
            if tensor.tensor_type.name not in supported:
                raise GGUFError(
                    f"model: tensor {tensor.name} in {self.path.name} is stored as {tensor.tensor_type.name}, "
                    f"which kvpilot cannot dequantize (supported: {', '.join(sorted(supported))})"
                )

    def model_config_fields(self) -> dict:
        """The ModelConfig fields this file's metadata gives (all but path and dtype)."""
        heads = self.arch_metadata("attention.head_count")
        hidden = self.arch_metadata("embedding_length")
        eos = self.metadata("tokenizer.ggml.eos_token_id")
        names = set(self.tensor_names)
        return dict(
            architecture=GGUF_ARCHITECTURES[self.arch],
            vocab_size=self.arch_metadata("vocab_size") or len(self.metadata("tokenizer.ggml.tokens", [])),
            hidden_size=hidden,
            intermediate_size=self.arch_metadata("feed_forward_length"),
            num_hidden_layers=self.arch_metadata("block_count"),
            num_attention_heads=heads,
            num_key_value_heads=self.arch_metadata("attention.head_count_kv") or heads,
            head_dim=self.arch_metadata("attention.key_length") or hidden // heads,
            max_position_embeddings=self.arch_metadata("context_length", 2048),
            rms_norm_eps=self.arch_metadata("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=self.arch_metadata("rope.freq_base", 10000.0),
            rope_scaling=self._rope_scaling(),
            # llama.cpp writes no output matrix when the model reuses its embedding.
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            eos_token_ids=[] if eos is None else [eos],
        )

    def _rope_scaling(self) -> dict | None:
        if "rope_freqs.weight" in self.tensor_names:
            # Llama 3 style per-frequency factors: the metadata omits the parameters to rebuild them.
            raise GGUFError(f"model: {self.path.name} uses per-frequency rope factors (rope_freqs), "
                            "which kvpilot does not implement for GGUF files")
        kind = self.arch_metadata("rope.scaling.type", "none")
        if kind == "none":
            return None
        if kind != "linear":
            raise GGUFError(f"model: {self.path.name} asks for rope scaling {kind!r}; "
                            "kvpilot implements only linear scaling for GGUF files")
        return {"rope_type": "linear", "factor": self.arch_metadata("rope.scaling.factor")}

    def iterate_weights(self, num_heads: int, num_kv_heads: int,
                        keep_packed: bool = False) -> Iterator[tuple[str, "np.ndarray | PackedWeight"]]:
        """(Hugging Face name, weight in Hugging Face layout) for every tensor, one at a time: a float32
        array, or with `keep_packed` a PackedWeight for the types the quantized matmul reads."""
        from gguf.quants import dequantize

        from kvpilot.kernels.cpu.quant_matmul import PACKED_TYPES

        for tensor in self._reader.tensors:
            name = hf_tensor_name(tensor.name)
            qtype = tensor.tensor_type.name
            # numpy's shape is ggml's reversed, which is already PyTorch's (out, in) order.
            shape = [int(n) for n in reversed(tensor.shape)]
            packed = keep_packed and qtype in PACKED_TYPES and len(shape) == 2
            if packed:
                # [rows, bytes per row], a copy (the map is read-only): the row reorder below
                # moves each row's blocks as they are.
                weight = np.array(tensor.data).reshape(shape[0], -1)
            elif qtype in _PLAIN_TYPES:
                weight = np.array(tensor.data, dtype=np.float32).reshape(shape)  # a copy: the map is read-only
            else:
                weight = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            if self.arch in _PERMUTED_QK and name.endswith(("q_proj.weight", "q_proj.bias")):
                weight = unpermute_rotary_rows(weight, num_heads)
            elif self.arch in _PERMUTED_QK and name.endswith(("k_proj.weight", "k_proj.bias")):
                weight = unpermute_rotary_rows(weight, num_kv_heads)
            yield name, self._as_packed(tensor.name, qtype, shape, weight) if packed else weight

    def kept_packed(self) -> tuple[list[str], list[str]]:
        """(packed, dequantized): the file's quantized matrix types that stay packed and those
        dequantized at load, each once."""
        from kvpilot.kernels.cpu.quant_matmul import PACKED_TYPES

        types = {t.tensor_type.name for t in self._reader.tensors
                 if t.tensor_type.name not in _PLAIN_TYPES and len(t.shape) == 2}
        return sorted(types & PACKED_TYPES), sorted(types - PACKED_TYPES)

    def _as_packed(self, gguf_name: str, qtype: str, shape: list[int], rows: np.ndarray) -> "PackedWeight":
        from kvpilot.kernels.cpu.quant_matmul import from_gguf

        try:
            return from_gguf(qtype, *shape, rows)
        except ValueError as err:
            raise GGUFError(f"model: tensor {gguf_name} in {self.path.name}: {err}") from None


@functools.cache
def _reader_class() -> type:
    # Imported here: HF-folder users and the operator never need the package.
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class TensorNamingReader(GGUFReader):
        """gguf's reader, naming the tensor whose type code is unknown, whose rows are not whole
        blocks, or whose data runs past the end of a cut file (the reader itself fails on an enum
        lookup or a numpy reshape that names no tensor)."""

        def __init__(self, path: Path) -> None:
            self.file_name = Path(path).name
            super().__init__(path)

        # The reader slices its file map once per value it reads, and a slice of an np.memmap runs a
        # Python __array_finalize__: a plain array over the same map slices for free (SmolLM2's
        # 49,152-token vocabulary: 2.6 -> 1.0 s a reader, paid by every process that opens the file).
        @property
        def data(self) -> np.ndarray:
            return self._map

        @data.setter
        def data(self, mapped: np.memmap) -> None:
            self._map = mapped.view(np.ndarray)

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            known = {int(qtype): size for qtype, size in GGML_QUANT_SIZES.items()}
            for field in fields:
                _, _, _, dims, raw_type, offset = field.parts
                if int(raw_type[0]) not in known:
                    raise GGUFError(f"model: tensor {field.name} in {self.file_name} has type "
                                    f"code {int(raw_type[0])}, which is no GGML type kvpilot knows")
                block, block_bytes = known[int(raw_type[0])]
                if int(dims[0]) % block:
                    raise GGUFError(f"model: tensor {field.name} in {self.file_name} has rows of "
                                    f"{int(dims[0])} values, which are not whole blocks of {block} "
                                    f"({GGMLQuantizationType(int(raw_type[0])).name})")
                end = start_offs + int(offset[0]) + int(np.prod(dims)) // block * block_bytes
                if end > len(self.data):
                    raise GGUFError(f"model: tensor {field.name} in {self.file_name} ends at byte "
                                    f"{end}, past the end of the file ({len(self.data)} bytes): the file is cut short")
            super()._build_tensors(start_offs, fields)

    return TensorNamingReader


def hf_tensor_name(gguf_name: str) -> str:
    base, _, param = gguf_name.rpartition(".")
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{param}"
    if base in _MODEL_TENSORS:
        return f"{_MODEL_TENSORS[base]}.{param}"
    raise GGUFError(f"model: GGUF tensor {gguf_name!r} has no counterpart in kvpilot's Llama model")


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order.

    Hugging Face rotates each head's first half against its second half; llama.cpp rotates adjacent
    pairs, so its converter interleaves the two halves of every head's rows. This puts them back.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
