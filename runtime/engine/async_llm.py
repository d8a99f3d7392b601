"""The frontend in the API-server process: validate, send to the EngineCore process, stream back.

Requests go out on a ZMQ ROUTER socket from the event loop (sends never block). Outputs come
back on a PULL socket read by one thread, which decodes them off the event loop and hands them
over with `call_soon_threadsafe`; everything per-request (detokenizing, stop strings, timings)
then happens on the loop, so no state is shared between threads.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import json
import logging
import multiprocessing
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import AsyncIterator, Callable

import msgspec
import zmq
from tokenizers import Tokenizer

from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine.core_process import run_engine_core
from kvpilot.runtime.engine.detokenizer import IncrementalDetokenizer
from kvpilot.runtime.engine.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    HandshakeReady,
    RequestType,
    UtilityCall,
)
from kvpilot.runtime.engine.output_processor import ChoiceState, OutputProcessor, StatLogger, StreamOutput
from kvpilot.runtime.engine.validation import validate_request
from kvpilot.runtime.request import SamplingParams

logger = logging.getLogger(__name__)

# How often the output thread, when no output arrives, checks that the engine is alive.
LIVENESS_POLL_MS = 200


class EngineDeadError(RuntimeError):
    """The EngineCore process is gone; no request can make progress."""


class AsyncLLM:
    """Owns the EngineCore process and the per-request output streams.

    Construction (blocking) spawns the EngineCore process with the validated config and waits
    for its handshake: ValueError for a model folder without a tokenizer, RuntimeError (with the
    engine's own message) when the engine fails to start.
    """

    def __init__(self, config: EngineConfig, startup_timeout: float = 300.0) -> None:
        self.config = config
        self.model_dir = config.model.path
        model_path = Path(self.model_dir)
        tokenizer_file = model_path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"model: no tokenizer.json in {self.model_dir}")
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        config_file = model_path / "tokenizer_config.json"
        self.tokenizer_config: dict = json.loads(config_file.read_text()) if config_file.is_file() else {}
        eos = self.config.model.eos_token_ids
        self.eos_token_id = eos[0] if eos else None
        self.vocab_size = self.config.model.vocab_size

        self._output_processor = OutputProcessor(self.tokenizer)
        # What the engine last reported, pushed after each step or answered to get_stats.
        self.latest_stats: EngineStats | None = None
        self._dead_callbacks: list[Callable[[str], None]] = []
        self._utility_calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._generate_calls = itertools.count()
        self._dead_reason: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._output_thread: threading.Thread | None = None
        self._closed = False

        self._ipc_dir = tempfile.mkdtemp(prefix="kvpilot-")
        input_address, output_address = f"ipc://{self._ipc_dir}/input", f"ipc://{self._ipc_dir}/output"
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.ROUTER)
        # Unlimited queue and an error, not a silent drop, if the engine is not connected.
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(input_address)
        self._output = self._context.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_address)
        self._process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(config, input_address, output_address),
            # Not a daemon: a daemonic process may not start the TP worker processes. The engine
            # leaves on its own when this process dies, and atexit stops it on a normal exit.
            name="kvpilot-engine-core", daemon=False,
        )
        self._process.start()
        atexit.register(self.shutdown)
        try:
            self._wait_for_handshake(startup_timeout)
        except BaseException:
            self.shutdown()
            raise

    def _wait_for_handshake(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self._input, zmq.POLLIN)
        poller.register(self._output, zmq.POLLIN)
        while time.monotonic() < deadline:
            events = dict(poller.poll(LIVENESS_POLL_MS))
            if self._output in events or not self._process.is_alive():
                # Before the handshake the engine only speaks to report its death.
                raise RuntimeError(f"the engine failed to start: {self._last_words()}")
            if self._input in events:
                self._engine_identity, payload = self._input.recv_multipart()
                ready = msgspec.msgpack.decode(payload, type=HandshakeReady)
                self.num_kv_blocks = ready.num_kv_blocks
                self.block_size = ready.block_size
                self.max_model_len = ready.max_model_len
                return
        raise RuntimeError(f"the engine did not start within {timeout:.0f} s")

    # -- tokens ---------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError naming the field (empty prompt, too long, ids out of vocab, logprobs > 20)."""
        validate_request(
            prompt_token_ids, params.for_choice(0),
            max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            num_kv_blocks=self.num_kv_blocks, block_size=self.block_size,
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
        self._start_output_thread()
        self._raise_if_dead()
        self.validate(prompt_token_ids, params)
        if self._output_processor.engine_ids_of({request_id}):
            raise ValueError(f"request_id {request_id!r} is already in use")
        # Unique per call: outputs the engine sent for an earlier request with the same id, before
        # it saw that request's ABORT, can never land in this one.
        call = next(self._generate_calls)
        engine_ids = [f"{request_id}-{call}-{index}" for index in range(params.n)]

        sink: asyncio.Queue = asyncio.Queue()
        # Every child is built and encoded before any is sent: a failure leaves nothing behind.
        children = []
        for index, engine_id in enumerate(engine_ids):
            child = params.for_choice(index)
            message = msgspec.msgpack.encode(EngineCoreRequest(
                request_id=engine_id, prompt_token_ids=prompt_token_ids, sampling_params=child,
                eos_token_id=self.eos_token_id, priority=priority, cache_salt=cache_salt,
            ))
            detokenizer = IncrementalDetokenizer(self.tokenizer, stop, include_stop_str_in_output)
            choice = ChoiceState(request_id, engine_id, index, child, len(prompt_token_ids), detokenizer, sink,
                                 tenant)
            children.append((choice, message))
        for choice, message in children:
            self._send_encoded(RequestType.ADD, message)
            self._output_processor.choices[choice.engine_id] = choice
        unfinished = set(engine_ids)
        try:
            while unfinished:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    unfinished.discard(engine_ids[item.index])
                yield item
        finally:
            if unfinished:
                self._abort(unfinished, notify=False)

    async def abort(self, request_ids: list[str]) -> None:
        """Abort client requests by id (each of their choices), as if their clients went away."""
        self._abort(self._output_processor.engine_ids_of(set(request_ids)), notify=True)

    def _abort(self, engine_ids, notify: bool) -> None:
        engine_ids = list(engine_ids)
        self._output_processor.abort(engine_ids, notify)
        if engine_ids and not self.errored:
            self._send(RequestType.ABORT, AbortRequests(request_ids=engine_ids))

    # -- utility calls --------------------------------------------------------------------------

    async def get_stats(self) -> EngineStats:
        return await self._call("get_stats")

    async def reset_prefix_cache(self) -> bool:
        return await self._call("reset_prefix_cache")

    async def set_scheduling_policy(self, policy: str) -> None:
        """Live from the next step; ValueError for an unknown policy."""
        await self._call("set_scheduling_policy", policy)

    async def _call(self, method: str, *args: str):
        self._start_output_thread()
        self._raise_if_dead()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = future
        self._send(RequestType.UTILITY, UtilityCall(call_id=call_id, method=method, args=list(args)))
        return await future

    # -- observers ------------------------------------------------------------------------------

    def add_stat_logger(self, logger: StatLogger) -> None:
        self._output_processor.stat_loggers.append(logger)

    def remove_stat_logger(self, logger: StatLogger) -> None:
        self._output_processor.stat_loggers.remove(logger)

    def on_engine_dead(self, callback: Callable[[str], None]) -> None:
        """Called once, on the event loop, with the reason, when the engine process dies.

        The watch runs on the event loop this is registered from (or, if registered outside a
        loop, the loop of the first request).
        """
        self._dead_callbacks.append(callback)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._start_output_thread()

    @property
    def errored(self) -> bool:
        return self._dead_reason is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._output_processor.choices)

    # -- plumbing -------------------------------------------------------------------------------

    def _send(self, request_type: RequestType, message) -> None:
        self._send_encoded(request_type, msgspec.msgpack.encode(message))

    def _send_encoded(self, request_type: RequestType, payload: bytes) -> None:
        try:
            self._input.send_multipart([self._engine_identity, request_type.value, payload])
        except zmq.ZMQError as err:
            # ROUTER_MANDATORY: the engine's socket is gone, before the liveness watch noticed.
            self._engine_died(f"the engine is unreachable: {err}")
            raise EngineDeadError(self._dead_reason) from None

    def _raise_if_dead(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)

    def _start_output_thread(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._output_thread = threading.Thread(target=self._read_outputs, name="frontend-output", daemon=True)
        self._output_thread.start()

    def _read_outputs(self) -> None:
        """Output thread: decode off the loop, hand over on the loop; watch the engine's pulse."""
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        while not self._closed:
            if not self._output.poll(LIVENESS_POLL_MS):
                if not self._process.is_alive() and not self._closed:
                    self._loop.call_soon_threadsafe(self._engine_died, self._last_words())
                    return
                continue
            message = decoder.decode(self._output.recv())
            self._loop.call_soon_threadsafe(self._process_outputs, message)
            if message.engine_dead is not None:
                return

    def _last_words(self) -> str:
        """Why the engine died: its own report if it got one out, else its exit code."""
        self._process.join(LIVENESS_POLL_MS / 1000)
        while self._output.poll(LIVENESS_POLL_MS):
            message = msgspec.msgpack.decode(self._output.recv(), type=EngineCoreOutputs)
            if message.engine_dead is not None:
                return message.engine_dead
        return f"the engine process exited with code {self._process.exitcode}"

    def _process_outputs(self, message: EngineCoreOutputs) -> None:
        stopped = self._output_processor.process_outputs(message.outputs)
        if stopped:
            # Ended here by a stop string; the engine would otherwise keep generating.
            self._send(RequestType.ABORT, AbortRequests(request_ids=stopped))
        if message.stats is not None:
            self.latest_stats = message.stats
            self._output_processor.record_engine_stats(message.stats)
        if message.utility_result is not None:
            result = message.utility_result
            if isinstance(result.value, EngineStats):
                self.latest_stats = result.value
            future = self._utility_calls.pop(result.call_id, None)
            if future is not None and not future.done():
                if result.error is None:
                    future.set_result(result.value)
                else:
                    future.set_exception(ValueError(result.error))
        if message.engine_dead is not None:
            self._engine_died(f"the engine failed: {message.engine_dead}")

    def _engine_died(self, reason: str) -> None:
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        logger.error("%s", reason)
        error = EngineDeadError(reason)
        self._output_processor.fail_all(error)
        for future in self._utility_calls.values():
            if not future.done():
                future.set_exception(error)
        self._utility_calls.clear()
        for callback in self._dead_callbacks:
            callback(reason)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine process (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._process.is_alive() and hasattr(self, "_engine_identity"):
            try:
                self._input.send_multipart([self._engine_identity, RequestType.SHUTDOWN.value, b""])
            except zmq.ZMQError:
                pass  # already unreachable: the kill below still ends it
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout)
        # The output thread owns its socket until it sees _closed, within one poll interval.
        if self._output_thread is not None:
            self._output_thread.join()
        self._input.close()
        self._output.close()
        self._context.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
