"""How the EngineCore reaches the model: in-process for one rank, through worker processes for TP.

TP workers are symmetric, as in vLLM V1: every rank gets the same SchedulerOutput, runs its shard
of the model (the layers all-reduce and all-gather between them) and samples the same tokens
from the same full logits with the same generators. Rank 0's output is the step's result. Each
rank also reports a fingerprint of its persistent batch after every step: ranks whose batches
differ would all-reduce one request's partial sums into another's, so the executor fails the
engine the moment they disagree rather than return wrong tokens.

Calls travel over one pipe per worker as msgspec msgpack bytes; nothing is pickled after the
workers start. A worker that dies fails the call at once instead of leaving the others waiting.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import traceback
from multiprocessing.connection import Connection, wait
from typing import Protocol

import msgspec
import torch

from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.core.sched.output import ModelRunnerOutput, SchedulerOutput
from kvpilot.runtime.engine.parent_watch import kill_with_parent, remove_if_orphaned
from kvpilot.runtime.lora.request import LoRARequest
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
    if config.parallel.tensor_parallel_size == 1:
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


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, device_type: str) -> None:
        self.world_size = config.parallel.tensor_parallel_size
        if device_type == "cuda" and torch.cuda.device_count() < self.world_size:
            raise ValueError(f"tensor_parallel_size={self.world_size} needs {self.world_size} GPUs, "
                             f"{torch.cuda.device_count()} are visible")
        self._rendezvous_dir = tempfile.mkdtemp(prefix="kvpilot-tp-")
        remove_if_orphaned(self._rendezvous_dir)
        context = multiprocessing.get_context("spawn")
        self._pipes: list[Connection] = []
        self._workers = []
        for rank in range(self.world_size):
            ours, theirs = context.Pipe()
            worker = context.Process(
                target=run_worker,
                args=(config, rank, device_type, f"file://{self._rendezvous_dir}/init", theirs),
                name=f"kvpilot-tp-worker-{rank}", daemon=True,
            )
            worker.start()
            theirs.close()
            self._pipes.append(ours)
            self._workers.append(worker)
        self._decoder = msgspec.msgpack.Decoder(WorkerReply)
        self._collect()  # each worker reports once its shard is loaded

    def kv_cache_bytes_per_block(self) -> int:
        return self._call("kv_cache_bytes_per_block")[0].value

    def kv_cache_budget_bytes(self) -> int:
        # The ranks hold equal shards, so the tightest rank decides for all.
        return min(reply.value for reply in self._call("kv_cache_budget_bytes"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call("initialize_kv_cache", num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        replies = self._call("execute_model", scheduler_output)
        layouts = [reply.layout for reply in replies]
        if len(set(layouts)) > 1:
            self._fail(RuntimeError(f"TP ranks disagree on the batch layout (fingerprint per rank: {layouts})"))
        return replies[0].output

    def add_lora(self, lora_request: LoRARequest) -> None:
        self._call("add_lora", lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        self._call("remove_lora", lora_int_id)

    def _call(self, method: str, argument=None) -> list[WorkerReply]:
        if not self._workers:
            raise WorkerDiedError("the TP workers are stopped")
        payload = msgspec.msgpack.encode(argument)
        for pipe in self._pipes:
            try:
                pipe.send_bytes(method.encode())
                pipe.send_bytes(payload)
            except OSError as exc:  # the worker's end is gone
                self._fail(RuntimeError(f"cannot reach a TP worker: {exc}"))
        return self._collect()

    def _collect(self) -> list[WorkerReply]:
        """Every rank's reply. The first error or death fails the call and stops every worker:
        the other ranks may be blocked in a collective with the missing one."""
        replies: dict[int, WorkerReply] = {}
        pending = dict(enumerate(self._pipes))
        while pending:
            handles = {pipe: rank for rank, pipe in pending.items()}
            handles.update({self._workers[rank].sentinel: rank for rank in pending})
            for ready in wait(list(handles)):
                rank = handles[ready]
                if rank not in pending:
                    continue
                if pending[rank].poll():
                    try:
                        reply = self._decoder.decode(pending.pop(rank).recv_bytes())
                    except (OSError, EOFError) as exc:  # the worker went away mid-reply
                        self._fail(RuntimeError(f"lost TP worker {rank}: {exc}"))
                    if reply.error is not None:
                        self._fail(RuntimeError(f"TP worker {rank} failed: {reply.error}"))
                    replies[rank] = reply
                elif not self._workers[rank].is_alive():
                    self._fail(WorkerDiedError(f"TP worker {rank} exited in the middle of a call"))
        return [replies[rank] for rank in range(self.world_size)]

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
        self.shutdown()
        if dead:
            rank, exit_code = dead[0]
            raise WorkerDiedError(f"TP worker {rank} exited with code {exit_code}")
        raise error

    def shutdown(self) -> None:
        for pipe in self._pipes:
            pipe.close()  # a worker sees EOF and exits
        for worker in self._workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.kill()
                worker.join()
        self._pipes, self._workers = [], []
        shutil.rmtree(self._rendezvous_dir, ignore_errors=True)


def run_worker(config: EngineConfig, rank: int, device_type: str, init_method: str, pipe: Connection) -> None:
    """TP worker process: join the group, load this rank's shard, then serve the executor's calls."""
    # The EngineCore decides when workers stop (EOF on the pipe), not signals to the process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Nor may a worker outlive the EngineCore, even one killed in the middle of a collective.
    kill_with_parent()
    world_size = config.parallel.tensor_parallel_size
    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # The ranks share the machine's cores; more threads each would only contend.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    encoder = msgspec.msgpack.Encoder()
    try:
        torch.distributed.init_process_group(
            "nccl" if device_type == "cuda" else "gloo", init_method=init_method, rank=rank, world_size=world_size,
        )
        # NCCL connects its transports at the first collective: make it now, so that a broken one
        # fails the engine's start rather than its first request.
        torch.distributed.all_reduce(torch.zeros(1, device=device))
        runner = ModelRunner(config, device)
    except BaseException as exc:  # noqa: BLE001 - reported to the executor, which fails the engine
        pipe.send_bytes(encoder.encode(WorkerReply(error=f"{type(exc).__name__}: {exc}")))
        raise
    pipe.send_bytes(encoder.encode(WorkerReply()))
    try:
        _serve(runner, rank, pipe, encoder)
    finally:
        # Not left to the interpreter's exit, where NCCL warns that work may still be pending.
        torch.distributed.destroy_process_group()


def _serve(runner: ModelRunner, rank: int, pipe: Connection, encoder: msgspec.msgpack.Encoder) -> None:
    """The executor's calls, one at a time, until it closes the pipe."""
    decoders = {name: msgspec.msgpack.Decoder(kind) if kind else None for name, kind in _ARGUMENT_TYPES.items()}
    while True:
        try:
            method = pipe.recv_bytes().decode()
            payload = pipe.recv_bytes()
        except EOFError:
            return
        try:
            decoder = decoders[method]
            result = getattr(runner, method)(*([decoder.decode(payload)] if decoder else []))
            if method == "execute_model":
                reply = WorkerReply(output=result if rank == 0 else None, layout=runner.batch.layout_fingerprint())
            else:
                reply = WorkerReply(value=result)
        except Exception as exc:  # noqa: BLE001 - the executor turns it into an engine failure
            logger.error("TP worker %d failed in %s:\n%s", rank, method, traceback.format_exc())
            reply = WorkerReply(error=f"{type(exc).__name__}: {exc}")
        pipe.send_bytes(encoder.encode(reply))
