"""What a request is: its sampling parameters, its tokens and where it stands in its life."""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpilot.runtime.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    # msgspec's; the operator's image, which imports this package's CLI, has no msgspec.
    from kvpilot.runtime.lora.request import LoRARequest

# Below this temperature sampling is argmax, as in vLLM.
GREEDY_TEMPERATURE = 1e-5


class ParamError(ValueError):
    """A ValueError that names the request field at fault (the `param` of the API's 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How to sample one request; field names and meanings follow vLLM's SamplingParams."""

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    # Strings that end the text; the frontend finds them (the engine only sees tokens). A single
    # string is taken as a list of one.
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Token id -> added to its logit before sampling (OpenAI's logit_bias, within +-100).
    logit_bias: dict[int, float] | None = None
    # A grammar the output must match (JSON schema, regex, choice, EBNF); see StructuredOutputsParams.
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's: subtracted from the logit of each token in the output so far, once (presence) or
    # once per occurrence (frequency); within [-2, 2].
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (CTRL's): a token of the prompt or the output has a positive logit divided by it and a
    # negative one multiplied; 1 is off, above 1 discourages repeats.
    repetition_penalty: float = 1.0
    # vLLM's: the only tokens that may be sampled; None allows every token.
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words, tokenized by the frontend: each sequence's last token is banned where the
    # output ends with the rest of it.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        # Written so that NaN, which fails every comparison, fails it too.
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite non-negative number, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError("min_tokens",
                             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be non-negative, got {value}")
        # Choice i samples with seed + i (for_choice): checked here, against n, so that the message
        # names the seed the caller gave and not a choice's. The API takes the same range.
        if self.seed is not None and not 0 <= self.seed <= 2**63 - self.n:
            raise ParamError("seed", f"seed must be in [0, 2**63 - n] (choice i samples with seed + i), "
                                     f"got {self.seed} with n={self.n}")
        # NaN fails every comparison, so it is refused too.
        if self.logit_bias is not None and any(not (0 <= token and -100 <= bias <= 100)
                                               for token, bias in self.logit_bias.items()):
            raise ValueError("logit_bias maps token ids (non-negative) to biases within [-100, 100]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise ParamError(name, f"{name} must be in [-2, 2], got {value}")
        if not 0 < self.repetition_penalty < float("inf"):
            raise ParamError("repetition_penalty",
                             f"repetition_penalty must be a finite number above 0, got {self.repetition_penalty}")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or min(self.allowed_token_ids) < 0):
            raise ParamError("allowed_token_ids", "allowed_token_ids must be a non-empty list of token ids")
        if any(not word or min(word) < 0 for word in self.bad_words_token_ids):
            raise ParamError("bad_words", "each bad word must be a non-empty sequence of token ids")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {self.stop_token_ids}")
        self.stop_token_ids = list(self.stop_token_ids)
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if "" in self.stop:
            raise ValueError("stop strings must not be empty")

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def for_choice(self, index: int) -> "SamplingParams":
        """The params of choice `index` of n: one sequence, and its own seed when seeded."""
        return dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + index)


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    # Waiting for its grammar to compile (vLLM's name); admitted once it has.
    WAITING_FOR_FSM = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything from here on is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence as the scheduler and the KV-cache manager see it.

    `num_computed_tokens` counts tokens whose KV is in the cache; the scheduler advances it
    when it schedules them and resets it to 0 on preemption (recompute).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        max_model_len: int | None = None,
        resume_token_ids: Sequence[int] = (),
        lora_request: LoRARequest | None = None,
    ) -> None:
        """`lora_request`: the adapter the request runs with (None: the base model alone).
        `resume_token_ids`: output this request produced before, elsewhere (a stream resumed on
        another replica). It is output like any other: it counts toward max_tokens, min_tokens and
        the penalties, and is computed again as a request preempted by recompute is."""
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        # Checked after every sampled token: a set, so that a long list costs nothing per token.
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        # Every token that can stop the request once min_tokens are out: one lookup per token.
        self.stopping_token_ids = self.stop_token_ids
        if eos_token_id is not None and not sampling_params.ignore_eos:
            self.stopping_token_ids = self.stop_token_ids | {eos_token_id}

        # Tokens this request may produce at most: max_tokens, bounded by the model length.
        limit = sampling_params.max_tokens
        if max_model_len is not None:
            room = max_model_len - len(self.prompt_token_ids)
            limit = room if limit is None else min(limit, room)
        if limit is None:
            raise ValueError("max_tokens is required when max_model_len is unknown")
        self.max_tokens = limit

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = list(resume_token_ids)
        self.all_token_ids: list[int] = self.prompt_token_ids + self.output_token_ids
        self.num_computed_tokens = 0
        # Tokens scheduled to be sampled but not yet received (at most one per step in flight):
        # under async scheduling the next step is scheduled before the last one's token is known.
        self.num_output_placeholders = 0
        # How many of its tokens the runners hold: under pipeline parallelism they learn a sampled
        # token only when the scheduler sends it with the request's next step.
        self.num_tokens_at_runners = 0
        # Prompt tokens served from the prefix cache when the request was first scheduled.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Hashes of the full blocks of all_token_ids, extended by the KV-cache manager.
        self.block_hashes: list[bytes] = []
        self.stop_reason: int | None = None
        # The grammar its output follows (a StructuredOutputRequest), set by the engine core.
        self.structured_output_request = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens}, priority={self.priority})"
        )
