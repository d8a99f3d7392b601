"""The frontend in the API-server process: tokenize, send to the EngineCore process, stream back.

(INTERFACE DRAFT: being implemented now; signatures below are the contract.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol

from kvpilot.runtime.config import EngineArgs
from kvpilot.runtime.engine.messages import EngineStats
from kvpilot.runtime.outputs import Logprob
from kvpilot.runtime.request import SamplingParams


class EngineDeadError(RuntimeError):
    """The EngineCore process is gone; no request can make progress."""


@dataclass
class StreamOutput:
    """What one request (one choice, when n > 1) gained since the previous StreamOutput."""

    request_id: str
    # Which of the n choices this is (0 when n == 1).
    index: int
    text: str
    token_ids: list[int]
    # One dict per new token (the sampled token plus the top-N), when logprobs were asked for.
    logprobs: list[dict[int, Logprob]] | None
    # "stop" | "length" | "abort" once finished, else None.
    finish_reason: str | None
    # The stop token id or stop string that ended it, if any.
    stop_reason: int | str | None
    num_prompt_tokens: int
    # Cumulative for this choice.
    num_output_tokens: int
    num_cached_tokens: int
    # Only on the first StreamOutput of a request that asked for prompt_logprobs: [None, {...}, ...].
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class FinishedRequestStats:
    """One finished (or aborted) choice, for the metrics; intervals on this process's monotonic clock."""

    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    e2e_latency: float
    # None when no token was produced.
    time_to_first_token: float | None
    inter_token_latencies: list[float] = field(default_factory=list)
    # Measured inside the EngineCore process; None if never scheduled.
    queue_time: float | None = None
    tenant: str | None = None


class StatLogger(Protocol):
    def record_engine_stats(self, stats: EngineStats) -> None: ...

    def record_finished_request(self, stats: FinishedRequestStats) -> None: ...


class AsyncLLM:
    """Owns the EngineCore process and the per-request output streams.

    Construction (blocking) validates the engine args in this process, spawns the EngineCore
    process and waits for its handshake; raises ValueError for bad args and RuntimeError when the
    engine fails to start (with the engine's own error message).
    """

    # Set after the handshake.
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    model_dir: str
    tokenizer: object  # tokenizers.Tokenizer
    tokenizer_config: dict  # tokenizer_config.json (chat_template, bos_token, eos_token, ...)
    eos_token_id: int | None

    def __init__(self, engine_args: EngineArgs, startup_timeout: float = 300.0) -> None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError naming the field (empty prompt, too long, ids out of vocab, logprobs > 20)."""

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        tenant: str | None = None,
    ) -> AsyncIterator[StreamOutput]:
        """Stream deltas until every one of the params.n choices finished.

        n > 1 fans out as child requests (seeds seed + i). Closing or cancelling the iterator
        (client disconnect) aborts whatever is unfinished, freeing its KV blocks. Raises
        ValueError for bad input (before anything is queued), EngineDeadError if the engine dies.
        Stop strings are detected here; the matching text is cut and the engine told to abort.
        """
        ...

    async def abort(self, request_ids: list[str]) -> None: ...

    async def get_stats(self) -> EngineStats: ...

    async def reset_prefix_cache(self) -> bool: ...

    async def set_scheduling_policy(self, policy: str) -> None:
        """Live from the next step; ValueError for an unknown policy."""

    def add_stat_logger(self, logger: StatLogger) -> None: ...

    def on_engine_dead(self, callback: Callable[[str], None]) -> None:
        """Called once, on the event loop, with the reason, when the engine process dies."""

    @property
    def errored(self) -> bool: ...

    @property
    def num_unfinished_requests(self) -> int: ...

    def shutdown(self) -> None:
        """Stop the engine process (idempotent)."""
