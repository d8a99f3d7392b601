"""The frontend in the API-server process: tokenize, validate, fan out n choices, stream back.

The EngineCoreClient owns the engine process and its sockets; the OutputProcessor turns its
step outputs into per-request deltas (text, stop strings, logprobs, timings). Both run on the
event loop; this class ties a request's queue to its choices and aborts what a consumer drops.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import Sequence
from typing import AsyncIterator, Callable

from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine.core_client import EngineCoreClient, EngineDeadError
from kvpilot.runtime.engine.messages import EngineCoreOutputs, EngineCoreRequest, EngineStats, Utility
from kvpilot.runtime.engine.output_processor import OutputProcessor, StatLogger, StreamOutput
from kvpilot.runtime.engine.validation import validate_request
from kvpilot.runtime.lora.request import LoRARequest
from kvpilot.runtime.models.tokenizer_loader import load_tokenizer
from kvpilot.runtime.request import ParamError, SamplingParams


class SlowConsumerError(RuntimeError):
    """A request's consumer left more outputs unread than its buffer holds; the request was aborted."""


class RequestRefusedError(ValueError):
    """The engine refused a request its frontend had passed (StreamOutput.error says why); a
    ValueError, as the frontend's own refusals are, so the server answers it with a 400."""


class OutputBuffer:
    """A request's deltas not read yet, at most `limit` of them (None: no bound): past it,
    `on_overflow` runs once, the consumer is left a SlowConsumerError after what it has not read,
    and later deltas are dropped.

    Not an asyncio.Queue: a delta put while the consumer waits wakes it with one future, and the
    deltas that arrive while it is busy are taken without any (a consumer behind by several
    engine steps reads them all in one task step).
    """

    def __init__(self, limit: int | None = None, on_overflow: Callable[[], None] = lambda: None) -> None:
        self.limit = limit
        self.on_overflow = on_overflow
        self.overflowed = False
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        if self.overflowed:
            return
        if self.limit is not None and len(self._items) >= self.limit and not isinstance(item, BaseException):
            self.overflowed = True
            self.on_overflow()
            item = SlowConsumerError(f"the client left more than {self.limit} outputs unread: aborted")
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self):
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class AsyncLLM:
    """The engine as an async API, for the OpenAI server.

    Construction (blocking) spawns the EngineCore process with the validated config and waits
    for its handshake: ValueError for a model folder without a tokenizer, RuntimeError (with the
    engine's own message) when the engine fails to start.
    """

    def __init__(self, config: EngineConfig, startup_timeout: float = 300.0) -> None:
        self.config = config
        self.model_dir = config.model.path
        self.tokenizer, self.tokenizer_config = load_tokenizer(self.model_dir, config.model.tokenizer)
        eos = self.config.model.eos_token_ids
        self.eos_token_id = eos[0] if eos else None
        self.vocab_size = self.config.model.vocab_size

        self.output_processor = OutputProcessor(self.tokenizer, config.scheduler.stream_interval)
        # What the engine last reported, pushed after each step or answered to get_stats.
        self.latest_stats: EngineStats | None = None
        self._scrape: asyncio.Future[EngineStats] | None = None
        self._generate_calls = itertools.count()
        self.engine_core = EngineCoreClient(
            config, on_outputs=self._process_outputs,
            on_dead=lambda reason: self.output_processor.fail_all(EngineDeadError(reason)),
            startup_timeout=startup_timeout,
        )
        self.num_kv_blocks = self.engine_core.num_kv_blocks
        self.block_size = self.engine_core.block_size
        self.max_model_len = self.engine_core.max_model_len

    # -- tokens ---------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, resume_token_ids: Sequence[int] = ()
                 ) -> None:
        """Raises ValueError naming the field (empty prompt, too long, ids out of vocab, logprobs > 20,
        a resumed output that does not fit the request)."""
        if resume_token_ids and params.n != 1:
            raise ParamError("resume_token_ids",
                             f"resume_token_ids continues one sequence: n must be 1, got {params.n}")
        validate_request(
            prompt_token_ids, params.for_choice(0),
            max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            num_kv_blocks=self.num_kv_blocks, block_size=self.block_size, resume_token_ids=resume_token_ids,
        )

    # -- requests -------------------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        tenant: str | None = None,
        max_buffered_outputs: int | None = None,
        resume_token_ids: Sequence[int] = (),
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[StreamOutput]:
        """Stream deltas until every one of the params.n choices finished.

        n > 1 fans out as child requests (seeds seed + i). Closing or cancelling the iterator
        (client disconnect) aborts whatever is unfinished, freeing its KV blocks. Raises
        ValueError for bad input (before anything is queued), RequestRefusedError (a ValueError)
        when the engine refuses it all the same, EngineDeadError if the engine dies.
        Stop strings (params.stop) are found by the OutputProcessor, which cuts the text; the
        engine is then told to abort. With max_buffered_outputs, a consumer that leaves more deltas
        than that unread gets the request aborted in the engine, and SlowConsumerError after the
        deltas it left.
        `resume_token_ids` (n == 1 only) continues output produced elsewhere: the deltas carry only
        what follows it, and num_output_tokens counts it (see Request).
        `lora_request`: the LoRA adapter the request runs with (None: the base model).
        """
        self.engine_core.ensure_running()
        self.validate(prompt_token_ids, params, resume_token_ids)
        if self.output_processor.engine_ids_of({request_id}):
            raise ValueError(f"request_id {request_id!r} is already in use")
        # Unique per call: outputs the engine sent for an earlier request with the same id, before
        # it saw that request's ABORT, can never land in this one.
        call = next(self._generate_calls)
        requests = [
            EngineCoreRequest(
                request_id=f"{request_id}-{call}-{index}", prompt_token_ids=prompt_token_ids,
                sampling_params=params.for_choice(index), eos_token_id=self.eos_token_id, priority=priority,
                cache_salt=cache_salt, resume_token_ids=list(resume_token_ids), lora_request=lora_request,
            )
            for index in range(params.n)
        ]
        engine_ids = [request.request_id for request in requests]
        unfinished = set(engine_ids)

        def overflowed() -> None:
            # Deferred: the output processor is in the middle of delivering this step.
            asyncio.get_running_loop().call_soon(self._abort, list(unfinished))
        sink = OutputBuffer(max_buffered_outputs, overflowed)
        self.engine_core.add_requests(requests)
        # Outputs reach the loop only between awaits, so none can arrive before this.
        for index, request in enumerate(requests):
            self.output_processor.add_request(request_id, request.request_id, index, request.sampling_params,
                                              prompt_token_ids, sink.put_nowait, tenant, params.n, resume_token_ids)
        try:
            while unfinished:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    unfinished.discard(engine_ids[item.index])
                if item.error is not None:
                    raise RequestRefusedError(item.error)
                yield item
        finally:
            if unfinished:
                self._abort(unfinished)

    def _abort(self, engine_ids) -> None:
        engine_ids = list(engine_ids)
        self.output_processor.abort(engine_ids)
        self.engine_core.abort_requests(engine_ids)

    def _process_outputs(self, message: EngineCoreOutputs) -> None:
        stopped = self.output_processor.process_outputs(message.outputs)
        # Ended here by a stop string; the engine would otherwise keep generating.
        self.engine_core.abort_requests(stopped)
        if message.stats is not None:
            self.latest_stats = message.stats
            self.output_processor.record_engine_stats(message.stats)

    # -- utility calls --------------------------------------------------------------------------

    async def get_stats(self) -> EngineStats:
        """The engine's stats, asked after whatever this caller changed."""
        self.latest_stats = await self.engine_core.call_utility(Utility.GET_STATS)
        return self.latest_stats

    async def scrape_stats(self) -> EngineStats:
        """The engine's stats for a scraper: a scrape that comes while another's call is in flight
        shares its answer, so a crowd of scrapers (/metrics needs no key) costs the engine one call
        at a time, not one each. A scraper that gives up leaves the call to the others."""
        if self._scrape is None:
            self._scrape = asyncio.ensure_future(self.get_stats())
            self._scrape.add_done_callback(self._scrape_done)
        return await asyncio.shield(self._scrape)

    def _scrape_done(self, call: asyncio.Future[EngineStats]) -> None:
        self._scrape = None
        if not call.cancelled():
            call.exception()  # retrieved here: a call every scraper gave up on would warn otherwise

    async def reset_prefix_cache(self) -> bool:
        return await self.engine_core.call_utility(Utility.RESET_PREFIX_CACHE)

    async def set_scheduling_policy(self, policy: str) -> None:
        """Live from the next step; ValueError for an unknown policy."""
        await self.engine_core.call_utility(Utility.SET_SCHEDULING_POLICY, policy)

    # -- observers ------------------------------------------------------------------------------

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Loads the adapter in the engine; ValueError naming the adapter and the problem when it
        does not fit the model (the engine keeps serving)."""
        await self.engine_core.call_utility(Utility.ADD_LORA, lora_request.lora_name,
                                            str(lora_request.lora_int_id), lora_request.lora_path)

    async def remove_lora(self, lora_int_id: int) -> None:
        await self.engine_core.call_utility(Utility.REMOVE_LORA, str(lora_int_id))

    def add_stat_logger(self, logger: StatLogger) -> None:
        self.output_processor.stat_loggers.append(logger)

    def on_engine_dead(self, callback: Callable[[str], None]) -> None:
        """See EngineCoreClient.on_engine_dead."""
        self.engine_core.on_engine_dead(callback)

    @property
    def errored(self) -> bool:
        return self.engine_core.errored

    def shutdown(self) -> None:
        """Stop the engine process (idempotent)."""
        self.engine_core.shutdown()
