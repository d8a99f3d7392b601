"""The frontend's side of each request: detokenize, cut at stop strings, decode logprobs, time it.

One ChoiceState per request in the engine (a client request with n choices has n). The
OutputProcessor turns the engine's per-step outputs into StreamOutput deltas for the request's
consumer, and reports each finished choice to the stat loggers. AsyncLLM and the offline LLM
share it, so the same tokens give the same text, stop and logprobs in both; it runs on one
thread (AsyncLLM's event loop).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable, Protocol

from tokenizers import Tokenizer

from kvpilot.runtime.engine.detokenizer import IncrementalDetokenizer
from kvpilot.runtime.engine.messages import EngineStats
from kvpilot.runtime.outputs import EngineCoreOutput, Logprob, TokenLogprobs
from kvpilot.runtime.request import SamplingParams


@dataclass(slots=True)
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
    # Cumulative for this choice, with the output it resumed (its usage).
    num_output_tokens: int
    num_cached_tokens: int
    # Only on the first StreamOutput of a request that asked for prompt_logprobs: [None, {...}, ...].
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # With finish_reason "abort": why the engine refused the request (EngineCoreOutput.error).
    error: str | None = None

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
    # From first scheduled to the first token: the time to first token less the queue time (the
    # socket hop to the engine, tens of microseconds, counts as prefill). None without a token.
    prefill_time: float | None = None
    # From the first token to the last (0 for one token).
    decode_time: float | None = None
    # The choice's max_tokens, and the client request's n (on its choice 0 only: one per request).
    max_tokens: int | None = None
    n: int | None = None


class StatLogger(Protocol):
    def record_engine_stats(self, stats: EngineStats) -> None: ...

    def record_finished_request(self, stats: FinishedRequestStats) -> None: ...

    def record_iteration(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        """One engine step's outputs: the prompts of the requests that got their first token in it,
        and the tokens it generated (vLLM's iteration stats)."""
        ...


# Where a choice's StreamOutputs go (or the error that ended the engine): a queue's put_nowait
# for AsyncLLM, a list's append for the offline LLM.
Sink = Callable[["StreamOutput | BaseException"], None]


class ChoiceState:
    """The frontend's state for one request in the engine (one choice of a client request)."""

    def __init__(self, request_id: str, engine_id: str, index: int, params: SamplingParams,
                 num_prompt_tokens: int, detokenizer: IncrementalDetokenizer, sink: Sink,
                 tenant: str | None, num_choices: int, num_resumed_tokens: int) -> None:
        self.request_id = request_id
        self.engine_id = engine_id
        self.index = index
        self.params = params
        self.num_choices = num_choices
        self.num_prompt_tokens = num_prompt_tokens
        self.detokenizer = detokenizer
        self.sink = sink
        self.tenant = tenant
        # Generated here; the metrics count these. The output it resumed (generated elsewhere)
        # counts only in its usage, as the engine counts it toward max_tokens.
        self.num_output_tokens = 0
        self.num_resumed_tokens = num_resumed_tokens
        self.num_cached_tokens = 0
        self.prompt_logprobs: dict[int, TokenLogprobs] = {}
        self.prompt_logprobs_sent = False
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.inter_token_latencies: list[float] = []
        self.queue_time: float | None = None
        # Tokens (and their logprobs) held back for --stream-interval, not yet in a StreamOutput.
        self.unsent_token_ids: list[int] = []
        self.unsent_logprobs: list[TokenLogprobs] = []
        self.sent_any = False

    def note_tokens(self, count: int, now: float) -> None:
        if count == 0:
            return
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            # Tokens arriving together (one step) share the interval.
            interval = (now - self.last_token_time) / count
            if count == 1:
                self.inter_token_latencies.append(interval)
            else:
                self.inter_token_latencies.extend([interval] * count)
        self.last_token_time = now
        self.num_output_tokens += count

    def stats(self, finish_reason: str) -> FinishedRequestStats:
        now = time.monotonic()
        prefill_time = decode_time = None
        if self.first_token_time is not None:
            ttft = self.first_token_time - self.arrival
            prefill_time = ttft if self.queue_time is None else max(0.0, ttft - self.queue_time)
            decode_time = self.last_token_time - self.first_token_time
        return FinishedRequestStats(
            finish_reason=finish_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_output_tokens,
            num_cached_tokens=self.num_cached_tokens,
            e2e_latency=now - self.arrival,
            time_to_first_token=None if self.first_token_time is None else self.first_token_time - self.arrival,
            inter_token_latencies=self.inter_token_latencies,
            queue_time=self.queue_time,
            tenant=self.tenant,
            prefill_time=prefill_time,
            decode_time=decode_time,
            max_tokens=self.params.max_tokens,
            n=self.num_choices if self.index == 0 else None,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, stream_interval: int = 1) -> None:
        """With `stream_interval` N > 1, a choice's StreamOutputs gather N tokens each (vLLM's
        --stream-interval), except its first token and its last output, which go out at once."""
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.choices: dict[str, ChoiceState] = {}
        self.stat_loggers: list[StatLogger] = []

    def add_request(self, request_id: str, engine_id: str, index: int, params: SamplingParams,
                    prompt_token_ids: list[int], sink: Sink, tenant: str | None = None, num_choices: int = 1,
                    resume_token_ids: Sequence[int] = ()) -> None:
        """Track choice `index` (of `num_choices`) of client request `request_id`, known to the engine
        as `engine_id`; `resume_token_ids` is the output it continues (see IncrementalDetokenizer)."""
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output,
                                             prompt_token_ids, resume_token_ids)
        self.choices[engine_id] = ChoiceState(request_id, engine_id, index, params, len(prompt_token_ids),
                                              detokenizer, sink, tenant, num_choices, len(resume_token_ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self.choices)

    def engine_ids_of(self, request_ids: set[str]) -> list[str]:
        return [engine_id for engine_id, choice in self.choices.items() if choice.request_id in request_ids]

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> list[str]:
        """Deliver one step's outputs; returns the choices a stop string ended, for the engine to abort."""
        now = time.monotonic()
        stopped = []
        num_prompt_tokens = num_generation_tokens = 0
        for output in outputs:
            choice = self.choices.get(output.request_id)
            if choice is None:
                continue
            if output.new_token_ids:
                num_generation_tokens += len(output.new_token_ids)
                if choice.first_token_time is None:
                    num_prompt_tokens += choice.num_prompt_tokens
            if self._process_output(choice, output, now):
                stopped.append(choice.engine_id)
        if outputs:
            for stat_logger in self.stat_loggers:
                stat_logger.record_iteration(num_prompt_tokens, num_generation_tokens)
        return stopped

    def record_engine_stats(self, stats: EngineStats) -> None:
        for stat_logger in self.stat_loggers:
            stat_logger.record_engine_stats(stats)

    def abort(self, engine_ids) -> None:
        """Forget the choices as aborted (their consumers are gone) and record them as such."""
        for engine_id in engine_ids:
            choice = self.choices.pop(engine_id, None)
            if choice is not None:
                self._record_finished(choice, "abort")

    def fail_all(self, error: BaseException) -> None:
        for choice in self.choices.values():
            choice.sink(error)
        self.choices.clear()

    def _process_output(self, choice: ChoiceState, output: EngineCoreOutput, now: float) -> bool:
        if output.queue_time is not None:
            choice.queue_time = output.queue_time
        choice.num_cached_tokens = max(choice.num_cached_tokens, output.num_cached_tokens)
        if output.new_prompt_logprobs is not None:
            chunk = output.new_prompt_logprobs
            for offset, entry in enumerate(chunk.entries):
                choice.prompt_logprobs[chunk.start + offset] = entry
        choice.note_tokens(len(output.new_token_ids), now)
        finish_reason, stop_reason = output.finish_reason, output.stop_reason
        stop_string = choice.detokenizer.update(output.new_token_ids)
        # Only a request the engine still runs needs aborting; either way the stop string is
        # why it ended, even when the same token also reached max_tokens.
        stopped_here = stop_string is not None and finish_reason is None
        if stop_string is not None:
            finish_reason, stop_reason = "stop", stop_string
        if not output.new_token_ids and finish_reason is None:
            return False  # a prefill chunk: nothing to show yet
        token_ids, logprobs = output.new_token_ids, output.new_logprobs
        if self.stream_interval > 1:
            choice.unsent_token_ids += token_ids
            choice.unsent_logprobs += logprobs or []
            if (finish_reason is None and choice.sent_any
                    and len(choice.unsent_token_ids) < self.stream_interval):
                return stopped_here
            token_ids, logprobs = choice.unsent_token_ids, choice.unsent_logprobs
            choice.unsent_token_ids, choice.unsent_logprobs = [], []
            choice.sent_any = True
        choice.sink(self._stream_output(choice, token_ids, logprobs, finish_reason, stop_reason, output.error))
        if finish_reason is not None:
            del self.choices[choice.engine_id]
            self._record_finished(choice, finish_reason)
        return stopped_here

    def _stream_output(self, choice: ChoiceState, token_ids: list[int], logprobs: list[TokenLogprobs] | None,
                       finish_reason: str | None, stop_reason, error: str | None) -> StreamOutput:
        prompt_logprobs = None
        if choice.params.prompt_logprobs is not None and not choice.prompt_logprobs_sent:
            choice.prompt_logprobs_sent = True
            prompt_logprobs = [None] + [
                self._decode_logprobs(choice.prompt_logprobs[pos])
                for pos in range(1, choice.num_prompt_tokens) if pos in choice.prompt_logprobs
            ]
        return StreamOutput(
            request_id=choice.request_id,
            index=choice.index,
            text=choice.detokenizer.take_new_text(finished=finish_reason is not None),
            token_ids=list(token_ids),
            logprobs=None if choice.params.logprobs is None else [self._decode_logprobs(e) for e in logprobs or []],
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_prompt_tokens=choice.num_prompt_tokens,
            num_output_tokens=choice.num_resumed_tokens + choice.num_output_tokens,
            num_cached_tokens=choice.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            error=error,
        )

    def _decode_logprobs(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        return {
            token: Logprob(logprob, rank, self.tokenizer.decode([token], skip_special_tokens=False))
            for token, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks)
        }

    def _record_finished(self, choice: ChoiceState, finish_reason: str) -> None:
        stats = choice.stats(finish_reason)
        for stat_logger in self.stat_loggers:
            stat_logger.record_finished_request(stats)
