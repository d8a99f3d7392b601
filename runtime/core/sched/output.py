"""What one scheduler step hands the model runner, and what the runner hands back."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.runtime.lora.slots import LoRAAssignment
from kvpilot.runtime.outputs import PromptLogprobsChunk, TokenLogprobs
from kvpilot.runtime.request import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has no row for: first scheduled, or resumed after preemption."""

    req_id: str
    # Prompt plus any output produced before a preemption: all of it is recomputed.
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # The device slot of its LoRA adapter (LoRASlots), -1 for the base model alone.
    lora_slot: int = -1


@dataclass
class CachedRequestData:
    """A request that already has a row and gained blocks (or, under pipeline parallelism, tokens)
    this step.

    A running request without either ships only its count in `num_scheduled_tokens`: the runner
    advances each row's computed tokens by the counts it runs.
    """

    req_id: str
    new_block_ids: list[int]
    # Under pipeline parallelism only the last stage samples, so the tokens reach every rank here,
    # with the request's next step: those sampled since it was last scheduled.
    new_token_ids: list[int] = field(default_factory=list)


@dataclass
class GrammarBitmask:
    """The allowed next tokens of the step's requests that have a grammar and sample this step.

    `bitmask` is an int32 array [len(req_ids), ceil(vocab / 32)] in its raw bytes (bit t % 32 of
    word t // 32 set: token t allowed), so that it crosses to the TP workers as it is.
    """

    req_ids: list[str]
    bitmask: bytes


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    # Only the running requests that gained blocks (see CachedRequestData).
    scheduled_cached_reqs: list[CachedRequestData]
    # Tokens to compute this step, per request; the sum is within max_num_batched_tokens.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Rows the runner drops before this step: finished or aborted since the last step. Lists, in
    # the order it happened, never sets: every TP rank replays them, and a set's iteration order
    # depends on each process's own string-hash seed.
    finished_req_ids: list[str] = field(default_factory=list)
    # Rows the runner drops too; these requests come back later as NewRequestData.
    preempted_req_ids: list[str] = field(default_factory=list)
    # Filled by the engine core after scheduling; None when no request samples under a grammar.
    grammar_bitmask: GrammarBitmask | None = None
    # The adapters of this step's admissions and their slots, in order (the scheduler's LoRASlots):
    # the workers fill the slots that held other adapters before this step.
    lora_assignments: list[LoRAAssignment] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # One list per scheduled request: empty while its prompt is still being prefilled.
    sampled_token_ids: list[list[int]]
    # Per request: one entry per sampled token, or None when logprobs were not asked for.
    logprobs: list[list[TokenLogprobs] | None]
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
