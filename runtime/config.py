"""The config spine: every engine setting's name, type, default, help and check, written once.

A setting is a dataclass field declared with `setting(...)` in one of the config classes below
(ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig). Everything else is derived from
those fields: `EngineArgs` (the keyword arguments of `LLM(...)`, vLLM's names), the engine
flags of `kvpilot serve` (see `cli.py`), and the error messages that name a setting.
`EngineArgs.create_engine_config()` checks every value once and returns the `EngineConfig` that
the engine process receives. Adding a setting is adding one field here (and reading it where it
is used).

Stdlib only: the API server and the CLI import this without torch.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpilot.runtime.cpu_bf16 import check_bfloat16_here

DTYPES = ("float32", "bfloat16", "float16")
# `auto`: the Triton kernels on CUDA, the C kernel (kernels/cpu/) on a CPU where it builds, else
# the torch reference.
# `auto` keeps a GGUF file's quantized matrices packed; `int8` quantizes a float checkpoint's at load.
QUANTIZATIONS = ("auto", "none", "int8")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# Tokens per KV block: powers of two up to 128 (the CRD's enum is checked against this).
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
# The KV budget on a CPU when none is given: there is no device memory to take a fraction of.
DEFAULT_CPU_KV_CACHE_BYTES = 512 * 1024**2


class SchedulingPolicy(enum.StrEnum):
    """The order the scheduler admits waiting requests in, and whom it preempts first."""

    FCFS = "fcfs"
    PRIORITY = "priority"

    @classmethod
    def parse(cls, value: str) -> "SchedulingPolicy":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"unknown scheduling policy {value!r}; expected one of {', '.join(cls)}"
            ) from None


@dataclass(frozen=True)
class Setting:
    """How one engine setting is described and checked; the field itself holds type and default."""

    help: str
    choices: tuple = ()
    minimum: int | float | None = None
    # An exclusive lower bound, for fractions such as gpu_memory_utilization.
    above: float | None = None
    maximum: int | float | None = None
    metavar: str | None = None
    # The EngineArgs keyword and flag name, where it differs from the field's (vLLM's names).
    arg: str | None = None
    # How a flag's text becomes the value, where calling the type on it cannot (a JSON object);
    # raises ValueError saying what is wrong.
    parse: Callable[[str], Any] | None = None

    def problem(self, value: Any) -> str | None:
        """Why `value` is not allowed, or None. Phrased to follow the setting's or flag's name."""
        if value is None:
            return None
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(map(str, self.choices))}, got {value!r}"
        if self.above is not None and not value > self.above:
            return f"must be greater than {self.above}, got {value}"
        if self.maximum is not None and value > self.maximum:
            return f"must be at most {self.maximum}, got {value}"
        if self.minimum is not None and value < self.minimum:
            if self.minimum in (0, 1) and isinstance(value, int):
                kind = "a positive integer" if self.minimum == 1 else "a non-negative integer"
                return f"must be {kind}, got {value}"
            return f"must be at least {self.minimum}, got {value}"
        return None


def setting(default: Any, help: str, **description: Any) -> Any:
    return field(default=default, metadata={"setting": Setting(help, **description)})


@dataclass(kw_only=True)
class ModelConfig:
    """What to run: the setting fields, then the facts the Llama-family model needs from the
    checkpoint (a Hugging Face `config.json`)."""

    dtype: str = setting("float32", "weight and activation dtype", choices=DTYPES)
    quantization: str = setting(
        "auto", "what the linear layers hold: auto keeps a GGUF file's quantized types packed (Q4_0, Q4_1, Q5_0, "
        "Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) and runs them with the quantized matmul on the CPU; none dequantizes "
        "every weight at load; int8 quantizes a Hugging Face checkpoint's linear weights per output row at "
        "load", choices=QUANTIZATIONS)
    seed: int = setting(0, "engine seed (requests without their own seed sample from it)", metavar="N")
    attention_backend: str = setting(
        "auto", "kernels for paged attention, KV-cache writes, RoPE and RMSNorm: triton (kernels/), cpu (the "
        "C paged-attention kernel in kernels/cpu/, compiled on first use) or torch (the reference); "
        "auto is triton on CUDA, cpu on a CPU (torch where cpu cannot build)", choices=ATTENTION_BACKENDS)
    tokenizer: str | None = setting(
        None, "take the tokenizer and chat template from this folder or .gguf file (default: the model's own)",
        metavar="PATH")
    enforce_eager: bool = setting(
        False, "run every step eagerly: no CUDA graphs for decode steps, and no decode batches padded "
        "to the captured sizes")

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
    # The span each token attends over, where the checkpoint restricts it (Mistral 7B v0.1: 4096).
    # The engine attends over the whole context, which is the same attention only up to it.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.quantization == "int8" and self.path.endswith(".gguf"):
            raise ValueError(f"--quantization int8 quantizes a float checkpoint at load; {Path(self.path).name} is "
                             "a GGUF file, whose own types --quantization auto keeps (or none dequantizes)")
        if self.quantization == "int8" and self.dtype != "float32":
            raise ValueError(f"--quantization int8 computes in float32; it cannot run with --dtype {self.dtype}")

    @property
    def torch_dtype(self):
        # Imported here so that the scheduler and its tests never pull in torch.
        import torch

        return getattr(torch, self.dtype)

    @classmethod
    def from_pretrained(cls, path: str | Path, **settings) -> "ModelConfig":
        """The checkpoint's facts from its `config.json` (or a GGUF file's metadata); `settings` are
        this class's setting fields."""
        if str(path).endswith(".gguf"):
            # Imported here: reading GGUF needs the gguf package (and numpy), which HF folders do not.
            from kvpilot.runtime.models.gguf_checkpoint import open_gguf

            return cls(path=str(path), **open_gguf(str(path)).model_config_fields(), **settings)
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model: no config.json in {path!s}")
        hf = json.loads(config_file.read_text())
        architecture = (hf.get("architectures") or ["?"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model: architecture {architecture!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        # The MLP computes silu(gate) * up; another activation would run as silu, without a word.
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"model: hidden_act {hf['hidden_act']!r} is not supported (the Llama family's is silu)")
        num_heads = hf["num_attention_heads"]
        # Qwen2 always has q/k/v bias; Llama and Mistral say so in `attention_bias`.
        attention_bias = architecture == "Qwen2ForCausalLM" or hf.get("attention_bias", False)
        rope_parameters = hf.get("rope_parameters") or {}
        # Qwen2's configs carry a window they do not use unless use_sliding_window says so.
        uses_window = architecture != "Qwen2ForCausalLM" or hf.get("use_sliding_window", False)
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
            eos_token_ids=_eos_token_ids(hf, Path(path) / "generation_config.json"),
            sliding_window=hf.get("sliding_window") if uses_window else None,
            **settings,
        )


def _eos_token_ids(hf: dict, generation_config: Path) -> list[int]:
    """config.json's EOS ids, then those only generation_config.json adds (transformers stops on those
    too: Llama 3 Instruct's <|eot_id|> may be named there alone)."""
    ids = _as_list(hf.get("eos_token_id"))
    if generation_config.is_file():
        try:
            ids += _as_list(json.loads(generation_config.read_text()).get("eos_token_id"))
        except (OSError, ValueError, AttributeError):
            pass  # a broken generation config is reported where its sampling defaults are read
    return list(dict.fromkeys(ids))


def _as_list(ids: int | list[int] | None) -> list[int]:
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)


def _scaling_part(rope_parameters: dict) -> dict | None:
    """transformers 5 folds rope_scaling into rope_parameters; only a non-default type matters."""
    if rope_parameters.get("rope_type", "default") == "default":
        return None
    return rope_parameters


KV_EVENT_PUBLISHERS = ("zmq", "null")


@dataclass(frozen=True, kw_only=True)
class KVEventsConfig:
    """vLLM's --kv-events-config: whether the engine publishes what its prefix cache stores and
    evicts (runtime/engine/kv_event_publisher.py), and on which sockets.

    Both sockets are bound, where vLLM connects to a host that is not a wildcard: routers connect
    to the engines they route to. vLLM's `buffer_steps` has no meaning here, as the replay socket
    answers with the whole cache, never with past steps.
    """

    enable_kv_cache_events: bool = False
    # vLLM's default: zmq once events are on, null (nothing published) otherwise.
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str = "tcp://*:5558"
    topic: str = "kv-events"
    # The PUB socket's send high-water mark, in batches: past it a slow subscriber loses batches,
    # sees a sequence gap and asks for a snapshot.
    hwm: int = 100_000
    # Batches the engine's step loop may hand its publisher thread ahead of it.
    max_queue_size: int = 100_000

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        for name, hint in typing.get_type_hints(KVEventsConfig).items():
            value, expected = getattr(self, name), _plain_type(hint)
            # True is an int to Python, never a queue size to a user.
            if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
                raise ValueError(f"{name} must be {expected.__name__}, got {value!r}")
        if self.publisher not in KV_EVENT_PUBLISHERS:
            raise ValueError(f"publisher must be one of {', '.join(KV_EVENT_PUBLISHERS)}, got {self.publisher!r}")
        for name in ("endpoint", "replay_endpoint"):
            if not getattr(self, name).startswith(("tcp://", "ipc://")):
                raise ValueError(f"{name} must be a tcp:// or ipc:// address, got {getattr(self, name)!r}")
        if self.endpoint == self.replay_endpoint:
            raise ValueError(f"endpoint and replay_endpoint must differ, both are {self.endpoint!r}")
        for name in ("hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        """The config a JSON object describes; ValueError naming the field that is wrong."""
        try:
            fields = json.loads(text)
        except ValueError as err:
            raise ValueError(f"not valid JSON: {err}") from None
        if not isinstance(fields, dict):
            raise ValueError(f"must be a JSON object, got {text!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        if "buffer_steps" in fields:
            raise ValueError("buffer_steps does not apply: the replay socket answers with the whole cache, "
                             "not with past steps")
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**fields)


@dataclass
class CacheConfig:
    """How the KV pool is laid out and how big it is: the first size setting that is set decides.

    num_gpu_blocks_override (blocks), kv_cache_memory_bytes (a byte budget), then on CUDA
    gpu_memory_utilization (the fraction of device memory the whole engine may hold), and on a
    CPU DEFAULT_CPU_KV_CACHE_BYTES.
    """

    block_size: int = setting(16, "tokens per KV-cache block", choices=BLOCK_SIZES, metavar="N")
    enable_prefix_caching: bool = setting(True, "reuse KV blocks of shared prefixes")
    # Block 0 is the null block, so a usable pool has at least two.
    num_gpu_blocks_override: int | None = setting(
        None, "KV-cache size in blocks (default: sized from the memory budget)", minimum=2, metavar="N")
    kv_cache_memory_bytes: int | None = setting(
        None, "KV-cache memory budget in bytes (default: from --gpu-memory-utilization on CUDA, 512 MiB on a CPU)",
        minimum=1, metavar="N")
    gpu_memory_utilization: float = setting(
        0.9, "fraction of GPU memory the engine may use, weights and KV cache together",
        above=0.0, maximum=1.0, metavar="FRACTION")
    kv_events_config: KVEventsConfig | None = setting(
        None, "publish the hashes of the blocks the prefix cache stores and evicts, for a prefix-aware router; "
        'a JSON object with vLLM\'s fields, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}\' (default: off)',
        metavar="JSON", parse=KVEventsConfig.from_json)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = setting(256, "most requests in one step", minimum=1, metavar="N")
    max_num_batched_tokens: int = setting(2048, "most tokens in one step", minimum=1, metavar="N")
    # None until the engine config is built, which resolves it to the model's own limit.
    max_model_len: int | None = setting(
        None, "longest prompt + output (default: the model's max_position_embeddings)", minimum=1, metavar="N")
    # Measured (BENCHMARKS.md, chunked prefill): without a cap, a 2,000-token prompt arriving among
    # 16 decoding requests ran as one step and froze their next token for 1.3 s (p99); 512-token
    # chunks cut that p99 to 0.16-0.18x, and the long prompt's own first token came sooner.
    long_prefill_token_threshold: int = setting(
        512, "largest prefill chunk per request and step; 0: no cap", minimum=0, metavar="N")
    policy: SchedulingPolicy = setting(
        SchedulingPolicy.FCFS, "initial policy (switchable live via /admin)",
        choices=tuple(SchedulingPolicy), arg="scheduling_policy")
    async_scheduling: bool = setting(
        False, "schedule the next step while the current one runs (outputs are the same as without)")
    # Read by the API server's output processor, as vLLM's is.
    stream_interval: int = setting(
        1, "tokens a stream gathers into one chunk (its first token and its end are sent at once)",
        minimum=1, metavar="N")


# Where the other hosts of a multi-host engine join host 0 (torch.distributed's usual port).
DEFAULT_MASTER_PORT = 29500


@dataclass
class ParallelConfig:
    """How the model is split over ranks: tensor_parallel_size ranks in each of pipeline_parallel_size
    stages, spread evenly over nnodes hosts. Host 0 runs the API server and the EngineCore."""

    tensor_parallel_size: int = setting(
        1, "tensor-parallel ranks: worker processes, one GPU each on CUDA", minimum=1, metavar="N")
    pipeline_parallel_size: int = setting(
        1, "pipeline stages: the model's layers split into this many consecutive groups, each run by its own "
        "tensor-parallel ranks", minimum=1, metavar="N")
    nnodes: int = setting(
        1, "hosts the ranks are spread over, tensor_parallel_size * pipeline_parallel_size / nnodes on each",
        minimum=1, metavar="N")
    node_rank: int = setting(
        0, "this host's index among --nnodes: 0 runs the API server and the EngineCore, the others run "
        "--headless", minimum=0, metavar="N")
    master_addr: str = setting(
        "127.0.0.1", "address of host 0, where the other hosts join", metavar="HOST")
    master_port: int = setting(
        DEFAULT_MASTER_PORT, "TCP port on host 0 where the other hosts join", minimum=1, maximum=65535,
        metavar="PORT")
    headless: bool = setting(
        False, "run this host's ranks and no API server (every host of a multi-host engine but node 0)")
    distributed_timeout: float = setting(
        60.0, "seconds a rank waits for the others, to join at start or to answer a step, before the engine "
        "fails naming the missing rank and host", above=0.0, metavar="SECONDS")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class LoRAConfig:
    enable_lora: bool = setting(False, "serve LoRA adapters (PEFT folders) on top of the base model")
    max_loras: int = setting(1, "most distinct adapters in one batch (adapter slots on the device)",
                             minimum=1, metavar="N")
    max_lora_rank: int = setting(16, "largest adapter rank accepted", minimum=1, metavar="N")
    max_cpu_loras: int | None = setting(
        None, "most adapters kept loaded in host memory, least recently used evicted first (default: --max-loras)",
        minimum=1, metavar="N")


@dataclass
class EngineConfig:
    """The validated configuration, built once by EngineArgs and handed to the engine process."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)


# EngineConfig's attribute -> the config class whose setting fields it holds.
_GROUPS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig,
           "lora": LoRAConfig}


@dataclass(frozen=True)
class EngineSetting:
    """One setting as the outside sees it: its EngineArgs keyword (and flag) and where it lives."""

    arg: str
    group: str
    field_name: str
    value_type: type
    default: Any
    description: Setting

    def check(self, value: Any) -> Any:
        """The value in its declared type; ValueError naming the setting when it is not allowed."""
        if value is not None and not self._has_type(value):
            raise ValueError(f"{self.arg} must be {self.value_type.__name__}, got {value!r}")
        if issubclass(self.value_type, enum.Enum) and value is not None:
            if value not in self.description.choices:
                raise ValueError(f"{self.arg} {self.description.problem(value)}")
            value = self.value_type(value)
        problem = self.description.problem(value)
        if problem is not None:
            raise ValueError(f"{self.arg} {problem}")
        return value

    def _has_type(self, value: Any) -> bool:
        if issubclass(self.value_type, enum.Enum):
            return isinstance(value, str)
        if isinstance(value, bool) and self.value_type is not bool:
            return False  # True is an int to Python, never a block count to a user
        if self.value_type is float:
            return isinstance(value, (int, float))
        return isinstance(value, self.value_type)


def _engine_settings() -> tuple[EngineSetting, ...]:
    settings = []
    for group, cls in _GROUPS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if "setting" not in f.metadata:
                continue
            description: Setting = f.metadata["setting"]
            settings.append(EngineSetting(description.arg or f.name, group, f.name, _plain_type(hints[f.name]),
                                          f.default, description))
    return tuple(settings)


def _plain_type(hint: Any) -> type:
    """`int | None` is an int that may be left unset."""
    return next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))


ENGINE_SETTINGS = _engine_settings()


class _EngineArgsMethods:
    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineArgs":
        unknown = sorted(set(kwargs) - {s.arg for s in ENGINE_SETTINGS})
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)

    def create_engine_config(self) -> EngineConfig:
        groups: dict[str, dict[str, Any]] = {group: {} for group in _GROUPS}
        for s in ENGINE_SETTINGS:
            groups[s.group][s.field_name] = s.check(getattr(self, s.arg))
        model = ModelConfig.from_pretrained(self.model, **groups["model"])
        if model.dtype == "bfloat16":
            check_bfloat16_here()
        scheduler = SchedulerConfig(**groups["scheduler"])
        scheduler.max_model_len = scheduler.max_model_len or min(
            model.max_position_embeddings, model.sliding_window or model.max_position_embeddings)
        # Rotary tables stop at the model's own limit; positions beyond it have no embedding.
        _require(scheduler.max_model_len <= model.max_position_embeddings, "max_model_len",
                 f"{scheduler.max_model_len} exceeds the model's max_position_embeddings "
                 f"({model.max_position_embeddings})")
        _require(model.sliding_window is None or scheduler.max_model_len <= model.sliding_window, "max_model_len",
                 f"{scheduler.max_model_len} exceeds the model's sliding_window ({model.sliding_window}): kvpilot "
                 "attends over the whole context, which is the window's attention only within the window")
        parallel = ParallelConfig(**groups["parallel"])
        _check_tensor_parallel(model, parallel.tensor_parallel_size)
        _check_layout(parallel)
        _require(parallel.pipeline_parallel_size <= model.num_hidden_layers, "pipeline_parallel_size",
                 f"{parallel.pipeline_parallel_size} is more stages than the model has layers ({model.num_hidden_layers})")
        lora = LoRAConfig(**groups["lora"])
        _require(not (lora.enable_lora and parallel.pipeline_parallel_size > 1), "enable_lora",
                 "is not supported with pipeline_parallel_size above 1 yet: the adapters' slots assume every layer "
                 "on each rank")
        # A host cache smaller than the slots would read adapters in use from disk again and again.
        _require(lora.max_cpu_loras is None or lora.max_cpu_loras >= lora.max_loras, "max_cpu_loras",
                 f"({lora.max_cpu_loras}) must be at least max_loras ({lora.max_loras})")
        return EngineConfig(model=model, cache=CacheConfig(**groups["cache"]), scheduler=scheduler,
                            parallel=parallel, lora=lora)


EngineArgs = dataclasses.make_dataclass(
    "EngineArgs",
    [("model", str)] + [(s.arg, s.value_type | None if s.default is None else s.value_type,
                         field(default=s.default)) for s in ENGINE_SETTINGS],
    bases=(_EngineArgsMethods,),
    namespace={"__doc__": "The keyword arguments of `LLM(...)`: `model`, then one per setting field "
                          "of the config classes, under vLLM's names (derived from ENGINE_SETTINGS)."},
)
EngineArgs.__module__ = __name__


def _check_tensor_parallel(model: ModelConfig, size: int) -> None:
    # Every rank holds whole heads; KV heads are split too, not replicated.
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(model, name)
        _require(value % size == 0, "tensor_parallel_size", f"{size} does not divide the model's {name} ({value})")
    if size > 1 and model.quantization == "auto" and model.path.endswith(".gguf"):
        # Refused here, before the workers start: a packed shard must hold whole blocks.
        from kvpilot.runtime.models.gguf_checkpoint import open_gguf

        problem = open_gguf(model.path).row_parallel_split_problem(size)
        _require(problem is None, "tensor_parallel_size", problem or "")


def _check_layout(parallel: ParallelConfig) -> None:
    _require(parallel.world_size % parallel.nnodes == 0, "nnodes",
             f"{parallel.nnodes} does not divide the {parallel.world_size} ranks "
             "(tensor_parallel_size * pipeline_parallel_size)")
    _require(parallel.node_rank < parallel.nnodes, "node_rank",
             f"{parallel.node_rank} is not below nnodes ({parallel.nnodes})")
    _require(parallel.headless == (parallel.node_rank > 0), "headless",
             "is for every host but node 0, which runs the API server" if parallel.headless
             else f"is needed on node {parallel.node_rank}: only node 0 runs the API server")


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")
