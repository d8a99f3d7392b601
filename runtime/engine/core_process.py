"""The EngineCore process: a busy loop around EngineCore, with its socket I/O on two threads.

The main thread only schedules and runs the model. An input thread receives and decodes
requests; an output thread encodes and sends results. Decoding and encoding thus overlap the
model step, and the busy loop never blocks on a socket.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import threading
import traceback
from typing import TYPE_CHECKING, Callable

import msgspec
import zmq

from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    HandshakeReady,
    RequestType,
    Utility,
    UtilityCall,
    UtilityResult,
)
from kvpilot.runtime.engine.parent_watch import exit_with_parent, remove_if_orphaned
from kvpilot.runtime.lora.request import LoRARequest
from kvpilot.runtime.outputs import EngineCoreOutput
from kvpilot.runtime.request import Request

if TYPE_CHECKING:
    from kvpilot.runtime.engine.core import EngineCore

logger = logging.getLogger(__name__)

_DECODERS = {
    RequestType.ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
    RequestType.ABORT: msgspec.msgpack.Decoder(AbortRequests),
    RequestType.UTILITY: msgspec.msgpack.Decoder(UtilityCall),
}

# What each utility call runs; a frontend can name nothing else (an unknown method fails to decode).
_UTILITIES: dict[Utility, Callable[..., object]] = {
    Utility.GET_STATS: lambda core: core.get_stats(),
    Utility.RESET_PREFIX_CACHE: lambda core: core.reset_prefix_cache(),
    Utility.SET_SCHEDULING_POLICY: lambda core, policy: core.set_scheduling_policy(policy),
    Utility.ADD_LORA: lambda core, name, lora_id, path: core.add_lora(LoRARequest(name, int(lora_id), path)),
    Utility.REMOVE_LORA: lambda core, lora_id: core.remove_lora(int(lora_id)),
}


def run_engine_core(config: EngineConfig, input_address: str, output_address: str) -> None:
    """Process entry point. Exits 0 on SHUTDOWN, 1 when the engine fails."""
    # Ctrl-C, or a SIGTERM sent to the whole process group, must not end the engine under the API
    # server's graceful drain: the server decides when we stop (SHUTDOWN, or SIGKILL).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    # Busy or idle, the engine ends within a poll of its API server's death, with its socket folder.
    remove_if_orphaned(os.path.dirname(input_address.removeprefix("ipc://")))
    exit_with_parent()
    context = zmq.Context()
    outputs: queue.Queue[EngineCoreOutputs | None] = queue.Queue()
    output_thread = threading.Thread(target=_send_outputs, args=(output_address, outputs),
                                     name="engine-output", daemon=True)
    output_thread.start()
    exit_code = 0
    try:
        # Imported here so that the API-server process, which only names this function as the
        # spawn target, never loads torch.
        from kvpilot.runtime.engine.core import EngineCore, default_device
        from kvpilot.runtime.worker import cpu_threads

        if config.parallel.world_size == 1 and default_device().type == "cpu":
            cpu_threads.set_engine_threads()  # the model runs in this process
        core = EngineCore(config)
        freeze_startup_heap()
        try:
            _EngineLoop(core, context, input_address, outputs).run()
        finally:
            core.shutdown()
    except BaseException as exc:  # noqa: BLE001 - whatever kills the engine is reported, then we exit
        logger.error("engine core failed:\n%s", traceback.format_exc())
        outputs.put(EngineCoreOutputs(engine_dead=f"{type(exc).__name__}: {exc}"))
        exit_code = 1
    outputs.put(None)
    output_thread.join(timeout=5)
    os._exit(exit_code)


def freeze_startup_heap() -> None:
    """Move every object alive after start-up into the cyclic GC's permanent generation.

    The model, the KV block pool (one object per block) and the libraries' objects live as long
    as the process; left in the collected generations, every full collection walks them all
    while the steps' short-lived objects are what it is after. vLLM's engine core does the same.
    """
    gc.collect()
    gc.freeze()


def _send_outputs(address: str, outputs: queue.Queue) -> None:
    # A context of its own, so that terminating it flushes exactly this socket: the last message
    # (often why the engine is exiting) must reach the API server before the process ends.
    context = zmq.Context()
    socket = context.socket(zmq.PUSH)
    socket.connect(address)
    encoder = msgspec.msgpack.Encoder()
    while (message := outputs.get()) is not None:
        socket.send(encoder.encode(message), copy=False)
    socket.close(linger=2000)
    context.term()


class _EngineLoop:
    def __init__(self, core: EngineCore, context: zmq.Context, input_address: str,
                 outputs: queue.Queue) -> None:
        self.core = core
        self.outputs = outputs
        self.inputs: queue.Queue[tuple[RequestType, object]] = queue.Queue()
        self.running = True
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(input_address)
        # The handshake travels on the input socket, so the API server's ROUTER learns our
        # identity before it has anything to send us.
        cache, sched = core.config.cache, core.config.scheduler
        ready = HandshakeReady(num_kv_blocks=core.num_kv_blocks, block_size=cache.block_size,
                               max_model_len=sched.max_model_len)
        socket.send(msgspec.msgpack.encode(ready))
        threading.Thread(target=self._receive_inputs, args=(socket,), name="engine-input", daemon=True).start()

    def _receive_inputs(self, socket: zmq.Socket) -> None:
        while True:
            frames = socket.recv_multipart()
            try:
                kind, payload = frames
                request_type = RequestType(kind)
                message = None if request_type is RequestType.SHUTDOWN else _DECODERS[request_type].decode(payload)
            except (ValueError, msgspec.DecodeError) as exc:
                # A malformed message is the sender's bug; dropping it keeps every other request alive.
                logger.error("dropped a malformed input message: %s", exc)
                continue
            self.inputs.put((request_type, message))

    def run(self) -> None:
        was_busy = False
        while self.running:
            busy = self.core.has_unfinished_requests()
            if busy:
                self._drain_inputs(block=False)
            else:
                if was_busy:
                    # One last report so the gauges read idle.
                    self.outputs.put(EngineCoreOutputs(stats=self.core.get_stats()))
                self._drain_inputs(block=True)
            was_busy = busy
            if self.running and self.core.has_unfinished_requests():
                step_outputs = self.core.step()
                self.outputs.put(EngineCoreOutputs(outputs=step_outputs, stats=self.core.get_stats()))

    def _drain_inputs(self, block: bool) -> None:
        """Handle every input that has arrived; with `block` (idle), wait for one first. An idle
        engine need not wake to look for its API server: the parent watch ends the process."""
        if block:
            self._handle(*self.inputs.get())
        while not self.inputs.empty():
            self._handle(*self.inputs.get_nowait())

    def _handle(self, request_type: RequestType, message) -> None:
        if request_type is RequestType.ADD:
            self._add(message)
        elif request_type is RequestType.ABORT:
            self.core.abort_requests(message.request_ids)
        elif request_type is RequestType.UTILITY:
            self.outputs.put(EngineCoreOutputs(utility_result=self._call_utility(message)))
        else:
            self.running = False

    def _add(self, message: EngineCoreRequest) -> None:
        request = Request(
            message.request_id, message.prompt_token_ids, message.sampling_params,
            eos_token_id=message.eos_token_id, priority=message.priority, cache_salt=message.cache_salt,
            max_model_len=self.core.config.scheduler.max_model_len, resume_token_ids=message.resume_token_ids,
            lora_request=message.lora_request,
        )
        try:
            finished = self.core.add_request(request)
        except ValueError as exc:
            # The frontend validates first, so this is a disagreement between the two: end the
            # request rather than the engine.
            logger.error("refused request %s: %s", message.request_id, exc)
            finished = EngineCoreOutput(request_id=message.request_id, new_token_ids=[], finish_reason="abort",
                                        error=f"the engine refused the request: {exc}")
        # Refused, or already ended by the output it was resumed with.
        if finished is not None:
            self.outputs.put(EngineCoreOutputs(outputs=[finished]))

    def _call_utility(self, call: UtilityCall) -> UtilityResult:
        try:
            value = _UTILITIES[call.method](self.core, *call.args)
        except (ValueError, TypeError) as exc:
            return UtilityResult(call_id=call.call_id, error=str(exc))
        return UtilityResult(call_id=call.call_id, value=value)
