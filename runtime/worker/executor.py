"""How the EngineCore reaches the model: in-process for one rank, through worker processes for TP
and PP.

Workers are symmetric, as in vLLM V1: every rank gets the same SchedulerOutput and updates the
same persistent batch. A TP rank runs its shard of its stage's layers (the layers all-reduce and
all-gather between them); a pipeline stage receives the residual stream from the stage before,
runs its layers and hands the stream on. The last stage's TP ranks sample the same tokens from
the same full logits with the same generators; the first of them gives the step's result, and
the scheduler sends the tokens to every rank with the next step. Under pipeline parallelism the
EngineCore submits a step while earlier ones are still in the later stages (`submit_model`, then
`collect_model` in order): each rank serves its calls in order, so the first stage starts step
N+1 while the second runs step N. Each rank also reports a fingerprint of its persistent batch
after every step: ranks whose batches differ would mix one request's partial sums or stream into
another's, so the executor fails the engine the moment they disagree rather than return wrong
tokens.

Calls travel over one pipe per worker as msgspec msgpack bytes; nothing is pickled after the
workers start. A worker that dies fails the call at once instead of leaving the others waiting.
Ranks on other hosts (--nnodes) get their calls through rank 0 (hosts.py).
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import queue
import shutil
import signal
import tempfile
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Protocol

import msgspec
import torch

from kvpilot.runtime import distributed
from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.core.sched.output import ModelRunnerOutput, SchedulerOutput
from kvpilot.runtime.engine.parent_watch import kill_with_parent, remove_if_orphaned
from kvpilot.runtime.lora.request import LoRARequest
from kvpilot.runtime.worker import cpu_threads, hosts
from kvpilot.runtime.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Executor(Protocol):
    def kv_cache_bytes_per_block(self) -> int: ...

    def kv_cache_budget_bytes(self) -> int: ...

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def add_lora(self, lora_request: LoRARequest) -> None: ...

    def remove_lora(self, lora_int_id: int) -> None: ...

    def shutdown(self) -> None: ...


def create_executor(config: EngineConfig, device: torch.device) -> Executor:
    if config.parallel.world_size == 1:
        return ModelRunner(config, device)
    return MultiprocExecutor(config, device.type)


class WorkerReply(msgspec.Struct, array_like=True, omit_defaults=True):
    error: str | None = None
    value: int | None = None
    output: ModelRunnerOutput | None = None
    # After execute_model: the rank's InputBatch.layout_fingerprint().
    layout: int | None = None


# What each call carries to the workers, by method name.
_ARGUMENT_TYPES = {
    "kv_cache_bytes_per_block": None,
    "kv_cache_budget_bytes": None,
    "initialize_kv_cache": int,
    "execute_model": SchedulerOutput,
    "add_lora": LoRARequest,
    "remove_lora": int,
}


class WorkerDiedError(RuntimeError):
    pass


# A call as rank 0 relays it to the other hosts' ranks: (method, payload); an empty method stops them.
_Call = tuple[str, bytes]


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, device_type: str) -> None:
        parallel = config.parallel
        self._output_rank = hosts.output_rank(parallel)
        local = len(hosts.host_ranks(parallel))
        if device_type == "cuda" and torch.cuda.device_count() < local:
            raise ValueError(f"{parallel.world_size} ranks (tensor_parallel_size * pipeline_parallel_size) "
                             f"over {parallel.nnodes} host(s) need {local} GPUs on this host, "
                             f"{torch.cuda.device_count()} are visible")
        self._rendezvous_dir = tempfile.mkdtemp(prefix="kvpilot-tp-")
        remove_if_orphaned(self._rendezvous_dir)
        # Across hosts, rank 0 relays every call (hosts.py): the others here need no pipe.
        self._workers, self._pipes = start_workers(config, device_type, self._rendezvous_dir,
                                                   piped=lambda rank: parallel.nnodes == 1 or rank == 0)
        self._decoder = msgspec.msgpack.Decoder(list[WorkerReply])
        self._collect()  # each worker reports once its shard is loaded (rank 0: every rank's)
        # Calls sent whose replies are not read yet: steps in the pipeline's later stages.
        self._unanswered = 0

    def kv_cache_bytes_per_block(self) -> int:
        # Pipeline stages may hold a layer more than others: the fullest stage's block decides.
        return max(reply.value for reply in self._call("kv_cache_bytes_per_block"))

    def kv_cache_budget_bytes(self) -> int:
        # The ranks hold equal shards, so the tightest rank decides for all.
        return min(reply.value for reply in self._call("kv_cache_budget_bytes"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call("initialize_kv_cache", num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit_model(scheduler_output)
        return self.collect_model()

    def submit_model(self, scheduler_output: SchedulerOutput) -> None:
        """Sends the step to the ranks without waiting for it."""
        self._send("execute_model", scheduler_output)

    def collect_model(self) -> ModelRunnerOutput:
        """The result of the oldest step submitted and not collected."""
        replies = self._answers()
        layouts = [reply.layout for reply in replies]
        if len(set(layouts)) > 1:
            self._fail(RuntimeError(f"ranks disagree on the batch layout (fingerprint per rank: {layouts})"))
        return replies[self._output_rank].output

    def add_lora(self, lora_request: LoRARequest) -> None:
        self._call("add_lora", lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        self._call("remove_lora", lora_int_id)

    def _call(self, method: str, argument=None) -> list[WorkerReply]:
        self._send(method, argument)
        return self._answers()

    def _answers(self) -> list[WorkerReply]:
        self._unanswered -= 1
        return self._collect()

    def _send(self, method: str, argument) -> None:
        if not self._workers:
            raise WorkerDiedError("the TP workers are stopped")
        payload = msgspec.msgpack.encode(argument)
        for pipe in self._pipes:
            try:
                pipe.send_bytes(method.encode())
                pipe.send_bytes(payload)
            except OSError as exc:  # the worker's end is gone
                self._fail(RuntimeError(f"cannot reach a TP worker: {exc}"))
        self._unanswered += 1

    def _collect(self) -> list[WorkerReply]:
        """Every rank's reply to the oldest call unanswered, in rank order. The first error or death fails the call and stops every
        worker: the other ranks may be blocked in a collective with the missing one."""
        replies: dict[int, list[WorkerReply]] = {}
        pending = dict(enumerate(self._pipes))  # the pipe of worker i is the i-th
        while pending:
            handles = {pipe: rank for rank, pipe in pending.items()}
            handles.update({self._workers[rank].sentinel: rank for rank in pending})
            for ready in wait(list(handles)):
                rank = handles[ready]
                if rank not in pending:
                    continue
                if pending[rank].poll():
                    try:
                        answers = self._decoder.decode(pending.pop(rank).recv_bytes())
                    except (OSError, EOFError) as exc:  # the worker went away mid-reply
                        self._fail(RuntimeError(f"lost TP worker {rank}: {exc}"))
                    for answering, reply in enumerate(answers, start=rank):
                        if reply.error is not None:
                            self._fail(RuntimeError(f"TP worker {answering} failed: {reply.error}"))
                    replies[rank] = answers
                elif not self._workers[rank].is_alive():
                    self._fail(WorkerDiedError(f"TP worker {rank} exited in the middle of a call"))
        return [reply for rank in sorted(replies) for reply in replies[rank]]

    def _fail(self, error: RuntimeError) -> None:
        """Stop every worker and raise: the first dead rank's exit code if one died (it explains its
        peers' failed collectives), else `error`."""
        # A killed worker's sockets close a moment before its exit status can be collected:
        # wait for the exits that are under way, then read their codes.
        exiting = set(wait([worker.sentinel for worker in self._workers], timeout=1.0))
        for worker in self._workers:
            if worker.sentinel in exiting:
                worker.join()
        dead = [(rank, w.exitcode) for rank, w in enumerate(self._workers) if w.exitcode not in (None, 0)]
        self._unanswered = 0  # the steps in flight fail with this one
        self.shutdown()
        if dead:
            rank, exit_code = dead[0]
            raise WorkerDiedError(f"TP worker {rank} exited with code {exit_code}")
        raise error

    def shutdown(self) -> None:
        # Steps still in the pipeline are let through: a rank would fail writing its reply to a
        # closed pipe, as if the engine had died under it.
        unanswered, self._unanswered = self._unanswered, 0
        try:
            for _ in range(unanswered if self._workers else 0):
                self._collect()
        except RuntimeError as exc:  # _fail has stopped the workers already
            logger.warning("a step still in flight at shutdown failed: %s", exc)
        for pipe in self._pipes:
            pipe.close()  # a worker sees EOF and exits
        for worker in self._workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.kill()
                worker.join()
        self._pipes, self._workers = [], []
        shutil.rmtree(self._rendezvous_dir, ignore_errors=True)


def start_workers(config: EngineConfig, device_type: str, rendezvous_dir: str, piped: Callable[[int], bool]
                  ) -> tuple[list[BaseProcess], list[Connection]]:
    """This host's ranks as processes, in rank order, and the pipes to those `piped(rank)` names."""
    context = multiprocessing.get_context("spawn")
    init = hosts.init_method(config.parallel, rendezvous_dir)
    workers, pipes = [], []
    for rank in hosts.host_ranks(config.parallel):
        ours, theirs = context.Pipe() if piped(rank) else (None, None)
        worker = context.Process(target=run_worker, args=(config, rank, device_type, init, theirs),
                                 name=f"kvpilot-tp-worker-{rank}", daemon=True)
        worker.start()
        if theirs is not None:
            theirs.close()
            pipes.append(ours)
        workers.append(worker)
    return workers, pipes


def run_headless(config: EngineConfig, device_type: str) -> int:
    """`kvpilot serve --headless`: this host's ranks of a multi-host engine, until host 0 stops them
    (0) or one of them fails (1, having said why)."""
    # A group's pods are all sent SIGTERM at once: leaving then would fail host 0's steps while it
    # drains its requests. Host 0's stop (or its loss) ends the ranks, and this host with them.
    signal.signal(signal.SIGTERM, lambda signum, frame: logger.info(
        "SIGTERM: this host's ranks stop when node 0 stops the engine"))
    workers, _ = start_workers(config, device_type, rendezvous_dir="", piped=lambda rank: False)
    for worker in workers:
        worker.join()
    failed = [(worker.name, worker.exitcode) for worker in workers if worker.exitcode != 0]
    for name, code in failed:
        logger.error("%s exited with code %s", name, code)
    return 1 if failed else 0


def run_worker(config: EngineConfig, rank: int, device_type: str, init_method: str, pipe: Connection | None) -> None:
    """A TP worker process: join the group, load this rank's shard, then serve the calls: the
    executor's, from `pipe`; or, without one, rank 0's relayed over the control group (hosts.py)."""
    # The EngineCore decides when workers stop (EOF on the pipe), not signals to the process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Nor may a worker outlive the EngineCore (or the headless host's process), even one killed in
    # the middle of a collective.
    kill_with_parent()
    parallel = config.parallel
    local = hosts.host_ranks(parallel)
    if device_type == "cuda":
        device = torch.device("cuda", rank - local.start)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        cpu_threads.set_engine_threads(ranks=len(local))
    encoder = msgspec.msgpack.Encoder()
    control = None
    try:
        try:
            torch.distributed.init_process_group(
                "nccl" if device_type == "cuda" else "gloo", init_method=init_method, rank=rank,
                world_size=parallel.world_size,
                timeout=datetime.timedelta(seconds=parallel.distributed_timeout),
            )
        except Exception as exc:  # noqa: BLE001 - the first line of torch's message says enough
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise RuntimeError(f"rank {rank} could not join the {parallel.world_size} ranks at "
                               f"{init_method} within {parallel.distributed_timeout:g} s "
                               f"(--distributed-timeout): {first_line}") from None
        # NCCL connects its transports at the first collective: make it now, so that a broken one
        # fails the engine's start rather than its first request.
        torch.distributed.all_reduce(torch.zeros(1, device=device))
        distributed.init_model_parallel(parallel.tensor_parallel_size)
        control = hosts.ControlGroup(parallel.distributed_timeout) if parallel.nnodes > 1 else None
        runner = ModelRunner(config, device)
        started = WorkerReply()
    except Exception as exc:  # noqa: BLE001 - reported to the executor, which fails the engine
        runner, started = None, WorkerReply(error=f"{type(exc).__name__}: {exc}")
    replies = _Replies(pipe, control, encoder)
    try:
        replies.deliver(started)
        if runner is not None:
            replies.start()
            try:
                _serve(runner, rank, pipe, control, encoder, replies.send,
                       gives_output=rank == hosts.output_rank(parallel))
            finally:
                replies.stop()
    except RuntimeError as exc:  # a collective of the control group failed: a host is gone
        if pipe is None:
            raise
        replies.fail(exc)
        return
    finally:
        if torch.distributed.is_initialized():
            # Not left to the interpreter's exit, where NCCL warns that work may still be pending.
            torch.distributed.destroy_process_group()
    if runner is None and pipe is None:
        raise SystemExit(1)  # a headless host's rank: its host's exit status tells


def _serve(runner: ModelRunner, rank: int, pipe: Connection | None, control: hosts.ControlGroup | None,
           encoder: msgspec.msgpack.Encoder, reply_with: Callable[[WorkerReply], None], gives_output: bool) -> None:
    """The calls, one at a time, until the executor closes the pipe (or rank 0 relays that it did)."""
    decoders = {name: msgspec.msgpack.Decoder(kind) if kind else None for name, kind in _ARGUMENT_TYPES.items()}
    calls = msgspec.msgpack.Decoder(_Call)
    while True:
        if pipe is not None:
            try:
                method, payload = pipe.recv_bytes().decode(), pipe.recv_bytes()
            except EOFError:
                method, payload = "", b""
            if control is not None:
                control.broadcast(encoder.encode((method, payload)))
        else:
            method, payload = calls.decode(control.broadcast())
        if not method:
            return
        try:
            decoder = decoders[method]
            result = getattr(runner, method)(*([decoder.decode(payload)] if decoder else []))
            if method == "execute_model":
                reply = WorkerReply(output=result if gives_output else None,
                                    layout=runner.batch.layout_fingerprint())
            else:
                reply = WorkerReply(value=result)
        except Exception as exc:  # noqa: BLE001 - the executor turns it into an engine failure
            logger.error("TP worker %d failed in %s:\n%s", rank, method, traceback.format_exc())
            reply = WorkerReply(error=f"{type(exc).__name__}: {exc}")
        reply_with(reply)


class _Replies:
    """A rank's replies on their way to the executor: straight down its pipe on one host. Across
    hosts, every rank's reply to a call goes to rank 0, which hands the executor all of them in
    rank order; rank 0 gathers them on a thread of its own, so that it starts the next call while a
    later pipeline stage is still running this one."""

    def __init__(self, pipe: Connection | None, control: hosts.ControlGroup | None,
                 encoder: msgspec.msgpack.Encoder) -> None:
        self._pipe, self._control, self._encoder = pipe, control, encoder
        self._queue: queue.SimpleQueue[WorkerReply | None] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._pipe is not None and self._control is not None:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._relay, name="kvpilot-replies", daemon=True)
            self._thread.start()

    def send(self, reply: WorkerReply) -> None:
        if self._queue is None:
            self.deliver(reply)
        else:
            self._queue.put(reply)

    def stop(self) -> None:
        """Once every reply sent is delivered (or the relay has failed)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()

    def deliver(self, reply: WorkerReply) -> None:
        replies = [reply]
        if self._control is not None:
            gathered = self._control.gather(self._encoder.encode(reply))
            replies = [msgspec.msgpack.decode(answer, type=WorkerReply) for answer in gathered]
        if self._pipe is not None:
            self._pipe.send_bytes(self._encoder.encode(replies))

    def fail(self, error: RuntimeError) -> None:
        """Tells the executor that a host is gone, which stops the engine; the exit code would only
        hide the message. Nothing to tell once the executor has hung up."""
        try:
            self._pipe.send_bytes(self._encoder.encode([WorkerReply(error=f"lost a rank on another host: {error}")]))
        except OSError:
            pass

    def _relay(self) -> None:
        while (reply := self._queue.get()) is not None:
            try:
                self.deliver(reply)
            except RuntimeError as exc:  # a host is gone: the calls after this one fail too
                self.fail(exc)
                return
