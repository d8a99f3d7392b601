"""What crosses the ZMQ sockets between the API server and the EngineCore process.

msgspec msgpack only, never pickle. SamplingParams is a dataclass, which msgspec encodes and
decodes natively; the per-step outputs are the Structs in `kvpilot.runtime.outputs`.

Input socket (API server ROUTER -> engine DEALER): frames `[request_type, payload]`.
Output socket (engine PUSH -> API server PULL): one `EngineCoreOutputs` per message.
"""

from __future__ import annotations

import enum

import msgspec

from kvpilot.runtime.config import SchedulingPolicy
from kvpilot.runtime.lora.request import LoRARequest
from kvpilot.runtime.outputs import EngineCoreOutput
from kvpilot.runtime.request import SamplingParams


class RequestType(enum.Enum):
    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"


class Utility(enum.Enum):
    """The EngineCore methods a frontend may call; the engine process maps each to its handler."""

    GET_STATS = "get_stats"
    RESET_PREFIX_CACHE = "reset_prefix_cache"
    SET_SCHEDULING_POLICY = "set_scheduling_policy"
    # vLLM's names: load an adapter into the workers' host caches (args: name, id, path), drop one (id).
    ADD_LORA = "add_lora"
    REMOVE_LORA = "remove_lora"


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    priority: int = 0
    cache_salt: str | None = None
    # Output already produced elsewhere, which the request continues (see Request).
    resume_token_ids: list[int] = []
    lora_request: LoRARequest | None = None


class AbortRequests(msgspec.Struct, array_like=True):
    request_ids: list[str]


class EngineStats(msgspec.Struct, array_like=True):
    """The engine's gauges and cumulative counters after a step."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    scheduling_policy: SchedulingPolicy
    # LoRA adapter names: those running requests use, those waiting requests name (vLLM's
    # vllm:lora_requests_info), and those the workers hold in host memory.
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []
    loaded_lora_adapters: list[str] = []


class UtilityCall(msgspec.Struct, array_like=True):
    call_id: int
    method: Utility
    args: list[str] = []


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    value: bool | EngineStats | None = None
    # The error's message when the call raised.
    error: str | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    stats: EngineStats | None = None
    utility_result: UtilityResult | None = None
    # The engine hit an error it cannot recover from and is exiting; the message says why.
    engine_dead: str | None = None


class HandshakeReady(msgspec.Struct, array_like=True):
    """Sent once by the engine after it loaded the model and sized the KV cache."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
