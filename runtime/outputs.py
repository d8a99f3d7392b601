"""What the engine returns: per-step deltas from the core, and the user-facing RequestOutput.

The per-step types are msgspec Structs because they cross the EngineCore's output socket as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs at one position: index 0 is the sampled (or actual prompt) token, then the top-N."""

    token_ids: list[int]
    logprobs: list[float]
    # Rank of each token in the full distribution, 1 = most likely.
    ranks: list[int]


class PromptLogprobsChunk(msgspec.Struct, array_like=True):
    """Prompt logprobs for prompt positions start .. start + len(entries) - 1."""

    start: int
    entries: list[TokenLogprobs]


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced for one request.

    One per running request per step, so it stays out of the cyclic GC (gc=False): it holds
    lists and Structs of numbers, which can never lead back to it.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: PromptLogprobsChunk | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    # Seconds from arrival at the engine to first scheduling: on the request's first output only.
    queue_time: float | None = None
    # Why the engine refused a request its frontend had passed (finish_reason "abort"): a
    # grammar that did not compile against the tokenizer, say. The frontend tells its client.
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    # The stop token id or stop string that ended it, if any.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
