"""The API server's link to the EngineCore process: spawn, handshake, sockets, liveness, utility calls.

Requests go out on a ZMQ ROUTER socket from the event loop (sends never block). Outputs come
back on a PULL socket read by one thread, which decodes them off the event loop and hands them
over with `call_soon_threadsafe`. On the loop, utility results complete their futures here and
the step outputs and stats go to the owner's `on_outputs`; no state is shared between threads.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import shutil
import tempfile
import threading
import time
from typing import Callable

import msgspec
import zmq

from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine.core_process import run_engine_core
from kvpilot.runtime.engine.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    HandshakeReady,
    RequestType,
    Utility,
    UtilityCall,
)

logger = logging.getLogger(__name__)

# How often the output thread, when no output arrives, checks that the engine is alive.
LIVENESS_POLL_MS = 200


class EngineDeadError(RuntimeError):
    """The EngineCore process is gone; no request can make progress."""


class EngineCoreClient:
    """Owns the EngineCore process and both sockets to it.

    Construction (blocking) spawns the process and waits for its handshake: RuntimeError (with
    the engine's own message) when the engine fails to start. `on_outputs` receives every
    message from the engine, on the event loop; `on_dead` the reason, once, when it dies.
    """

    def __init__(self, config: EngineConfig, on_outputs: Callable[[EngineCoreOutputs], None],
                 on_dead: Callable[[str], None], startup_timeout: float = 300.0) -> None:
        self._on_outputs = on_outputs
        self._dead_callbacks: list[Callable[[str], None]] = [on_dead]
        self._utility_calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
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

    # -- requests -------------------------------------------------------------------------------

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Every request is encoded before any is sent: an encoding failure leaves nothing behind."""
        for payload in [msgspec.msgpack.encode(request) for request in requests]:
            self._send_encoded(RequestType.ADD, payload)

    def abort_requests(self, request_ids: list[str]) -> None:
        # After shutdown (an iterator closed late) there is no engine left to tell.
        if request_ids and not self.errored and not self._closed:
            self._send(RequestType.ABORT, AbortRequests(request_ids=request_ids))

    async def call_utility(self, method: Utility, *args: str):
        """The engine's return value; ValueError with the engine's message if the method raised."""
        self.ensure_running()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = future
        self._send(RequestType.UTILITY, UtilityCall(call_id=call_id, method=method, args=list(args)))
        return await future

    # -- liveness -------------------------------------------------------------------------------

    def ensure_running(self) -> None:
        """Starts the output thread on the running loop (the first call); EngineDeadError if dead."""
        self._start_output_thread()
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)

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

    def _start_output_thread(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._output_thread = threading.Thread(target=self._read_outputs, name="frontend-output", daemon=True)
        self._output_thread.start()

    def _read_outputs(self) -> None:
        """Output thread: decode off the loop, hand over on the loop; watch the engine's pulse."""
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        try:
            while not self._closed:
                if not self._output.poll(LIVENESS_POLL_MS):
                    if not self._process.is_alive() and not self._closed:
                        self._loop.call_soon_threadsafe(self._engine_died, self._last_words())
                        return
                    continue
                message = decoder.decode(self._output.recv())
                self._loop.call_soon_threadsafe(self._handle, message)
                if message.engine_dead is not None:
                    return
        except RuntimeError:
            # The loop was closed before shutdown(): nobody is left to hand anything to.
            if not self._loop.is_closed():
                raise

    def _last_words(self) -> str:
        """Why the engine died: its own report if it got one out, else its exit code."""
        self._process.join(LIVENESS_POLL_MS / 1000)
        while self._output.poll(LIVENESS_POLL_MS):
            message = msgspec.msgpack.decode(self._output.recv(), type=EngineCoreOutputs)
            if message.engine_dead is not None:
                return message.engine_dead
        return f"the engine process exited with code {self._process.exitcode}"

    def _handle(self, message: EngineCoreOutputs) -> None:
        self._on_outputs(message)
        if message.utility_result is not None:
            result = message.utility_result
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
