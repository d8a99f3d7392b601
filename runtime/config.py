"""Engine configuration: one place for the defaults, the validation and the vLLM names."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

SCHEDULING_POLICIES = ("fcfs", "priority")
DTYPES = ("float32", "bfloat16", "float16")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass
class ModelConfig:
    """The parts of a Hugging Face `config.json` the Llama-family model needs."""

    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: list[int]
    dtype: str

    @property
    def torch_dtype(self):
        # Imported here so that the scheduler and its tests never pull in torch.
        import torch

        return getattr(torch, self.dtype)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: str = "float32") -> "ModelConfig":
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model: no config.json in {path!s}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        hf = json.loads(config_file.read_text())
        architecture = (hf.get("architectures") or ["?"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model: architecture {architecture!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        # Qwen2 always has q/k/v bias; Llama and Mistral say so in `attention_bias`.
        attention_bias = architecture == "Qwen2ForCausalLM" or hf.get("attention_bias", False)
        rope_parameters = hf.get("rope_parameters") or {}
        return cls(
            path=str(path),
            architecture=architecture,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=hf.get("rope_theta", rope_parameters.get("rope_theta", 10000.0)),
            rope_scaling=hf.get("rope_scaling") or _scaling_part(rope_parameters),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=bool(attention_bias),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            dtype=dtype,
        )


def _scaling_part(rope_parameters: dict) -> dict | None:
    """transformers 5 folds rope_scaling into rope_parameters; only a non-default type matters."""
    if rope_parameters.get("rope_type", "default") == "default":
        return None
    return rope_parameters


# The KV budget on a CPU when none is given: there is no device memory to take a fraction of.
DEFAULT_CPU_KV_CACHE_BYTES = 512 * 1024**2


@dataclass
class CacheConfig:
    """How big the KV pool is: the first of these that is set decides.

    num_gpu_blocks_override (blocks), kv_cache_memory_bytes (a byte budget), then on CUDA
    gpu_memory_utilization (the fraction of device memory the whole engine may hold), and on a
    CPU DEFAULT_CPU_KV_CACHE_BYTES.
    """

    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0
    # Largest prefill chunk one request may take in a step; 0 means no cap.
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"


@dataclass
class EngineArgs:
    """The keyword arguments of `LLM(...)`, named as vLLM names them."""

    model: str
    dtype: str = "float32"
    seed: int = 0
    tensor_parallel_size: int = 1
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineArgs":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)

    def create_engine_config(self) -> "EngineConfig":
        model = ModelConfig.from_pretrained(self.model, self.dtype)
        max_model_len = self.max_model_len or model.max_position_embeddings
        _require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size",
                 f"must be a power of two up to 128, got {self.block_size}")
        _check_tensor_parallel(model, self.tensor_parallel_size)
        _require(self.max_num_seqs >= 1, "max_num_seqs", f"must be at least 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
                 f"must be at least 1, got {self.max_num_batched_tokens}")
        _require(max_model_len >= 1, "max_model_len", f"must be at least 1, got {max_model_len}")
        # Rotary tables stop at the model's own limit; positions beyond it have no embedding.
        _require(max_model_len <= model.max_position_embeddings, "max_model_len",
                 f"{max_model_len} exceeds the model's max_position_embeddings ({model.max_position_embeddings})")
        _require(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold",
                 f"must be non-negative, got {self.long_prefill_token_threshold}")
        _require(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy",
                 f"must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        _require(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 2,
                 "num_gpu_blocks_override",
                 f"must be at least 2 (block 0 is reserved), got {self.num_gpu_blocks_override}")
        _require(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes",
                 f"must be positive, got {self.kv_cache_memory_bytes}")
        _require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
                 f"must be in (0, 1], got {self.gpu_memory_utilization}")
        return EngineConfig(
            model=model,
            cache=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=max_model_len,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                policy=self.scheduling_policy,
            ),
            seed=self.seed,
            tensor_parallel_size=self.tensor_parallel_size,
        )


def _check_tensor_parallel(model: ModelConfig, size: int) -> None:
    _require(size >= 1, "tensor_parallel_size", f"must be at least 1, got {size}")
    # Every rank holds whole heads; KV heads are split too, not replicated.
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(model, name)
        _require(value % size == 0, "tensor_parallel_size", f"{size} does not divide the model's {name} ({value})")


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0
    tensor_parallel_size: int = 1
