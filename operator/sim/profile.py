"""What one replica costs per scheduler step, and how much KV it holds.

A step that schedules `tokens` new tokens for `sequences` requests whose KV after the step spans
`context` tokens in all takes

    base_s + per_token_s * tokens + per_sequence_s * sequences + per_context_token_s * context

seconds: the weights read once per step (base), the matmuls per token, what each request in the
batch costs apart from its tokens (its row of the input batch, its sampling, its attention
call), and the attention's read of the KV cache. A decode token pays per_token_s and
per_sequence_s; a prompt token only per_token_s, its request's per_sequence_s once per step.
`kvpilot simulate calibrate` fits the four coefficients to the real engine's steps, timed one
by one; the built-in profiles below are rooflines of published hardware and model figures, with
the efficiencies they assume written next to them (no per-sequence term: a roofline has none).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Profile:
    name: str
    source: str  # where the numbers come from
    base_s: float
    per_token_s: float
    per_context_token_s: float
    num_gpu_blocks: int  # the KV pool, in blocks of block_size tokens
    block_size: int = 16
    per_sequence_s: float = 0.0
    # While `calibrate` timed the steps: the share of the time their threads were runnable that
    # they ran on a core (below 1 on a shared machine: the costs above have those waits taken
    # out); None for a roofline.
    cpu_share: float | None = None
    # What a request spends outside the engine's steps before its first token reaches the client:
    # the HTTP request, the hop to the engine process and back, the first SSE chunk. A replica
    # sees each arrival this much later. Measured against a real server by bench/sim_validation.py;
    # 0 in `calibrate` (in process, no server) and in the rooflines (no published figure).
    frontend_s: float = 0.0

    def __post_init__(self) -> None:
        costs = (self.base_s, self.per_token_s, self.per_sequence_s, self.per_context_token_s)
        if min(costs) < 0 or self.base_s + self.per_token_s + self.per_sequence_s <= 0:
            raise ValueError(f"profile {self.name}: step costs must be non-negative and a step must take time")
        if self.frontend_s < 0:
            raise ValueError(f"profile {self.name}: frontend_s must be non-negative")
        if self.num_gpu_blocks < 1 or self.block_size < 1:
            raise ValueError(f"profile {self.name}: num_gpu_blocks and block_size must be positive")

    def step_seconds(self, tokens: float, sequences: float, context: float) -> float:
        return (self.base_s + self.per_token_s * tokens + self.per_sequence_s * sequences
                + self.per_context_token_s * context)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Profile:
        try:
            fields = json.loads(path.read_text())
            return cls(**fields)
        except (OSError, json.JSONDecodeError, TypeError) as error:
            raise ValueError(f"{path}: not a simulator profile ({error})") from error


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: float
    bandwidth_bytes_s: float
    dense_flops: float  # at the weights' dtype


@dataclass(frozen=True)
class Model:
    name: str
    parameters: float
    weight_bytes: float
    kv_bytes_per_token: float  # layers x kv heads x head dim x 2 (K and V) x bytes per value


# NVIDIA's H200 SXM datasheet: 141 GB HBM3e at 4.8 TB/s; 989 TFLOPS dense BF16, 1,979 FP8.
H200_BF16 = Gpu("H200 (BF16)", 141e9, 4.8e12, 989e12)
H200_FP8 = Gpu("H200 (FP8)", 141e9, 4.8e12, 1979e12)
# Meta's Llama 3.1 model cards: 8.03B parameters, 32 layers; 70.6B, 80 layers; 8 KV heads of 128.
LLAMA_8B_BF16 = Model("Llama-3.1-8B BF16", 8.03e9, 16.06e9, 32 * 8 * 128 * 2 * 2)
LLAMA_70B_FP8 = Model("Llama-3.1-70B FP8 (FP8 KV cache)", 70.6e9, 70.6e9, 80 * 8 * 128 * 2 * 1)

# Assumed shares of the peaks a well-tuned engine reaches (vLLM's decode is bandwidth-bound
# near 80 %, its prefill near half the dense peak), and its per-step overhead.
BANDWIDTH_EFFICIENCY = 0.8
FLOPS_EFFICIENCY = 0.5
STEP_OVERHEAD_S = 1e-3
GPU_MEMORY_UTILIZATION = 0.9
ACTIVATION_RESERVE_BYTES = 4e9


def roofline(gpu: Gpu, model: Model, *, block_size: int = 16) -> Profile:
    bandwidth = gpu.bandwidth_bytes_s * BANDWIDTH_EFFICIENCY
    kv_bytes = gpu.memory_bytes * GPU_MEMORY_UTILIZATION - model.weight_bytes - ACTIVATION_RESERVE_BYTES
    return Profile(
        name=f"{model.name} on one {gpu.name}",
        source=(f"roofline: datasheet peaks x {BANDWIDTH_EFFICIENCY:g} bandwidth, x {FLOPS_EFFICIENCY:g} FLOPS,"
                f" {STEP_OVERHEAD_S * 1e3:g} ms per step, KV cache in {GPU_MEMORY_UTILIZATION:g} of memory"
                " less weights and 4 GB of activations"),
        base_s=model.weight_bytes / bandwidth + STEP_OVERHEAD_S,
        per_token_s=2 * model.parameters / (gpu.dense_flops * FLOPS_EFFICIENCY),
        per_context_token_s=model.kv_bytes_per_token / bandwidth,
        num_gpu_blocks=math.floor(kv_bytes / model.kv_bytes_per_token / block_size),
        block_size=block_size,
    )


BUILTIN = {
    "h200-llama-8b": roofline(H200_BF16, LLAMA_8B_BF16),
    "h200-llama-70b-fp8": roofline(H200_FP8, LLAMA_70B_FP8),
}


def resolve(name_or_path: str) -> Profile:
    """A built-in profile by name, or a JSON profile file (as `calibrate` writes)."""
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"not a built-in profile ({', '.join(BUILTIN)}) or a profile file: {name_or_path}")
    return Profile.load(path)
