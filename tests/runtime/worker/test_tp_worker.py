"""A TP worker's life in this process: gloo, one rank, a stand-in for the model runner."""

from __future__ import annotations

import multiprocessing
import threading
from types import SimpleNamespace

import msgspec
import torch
import torch.distributed as dist

from kvpilot.runtime.config import ParallelConfig
from kvpilot.runtime.worker import executor


CONFIG = SimpleNamespace(parallel=ParallelConfig(distributed_timeout=30))
REPLIES = msgspec.msgpack.Decoder(list[executor.WorkerReply])


def _replies(pipe) -> list[executor.WorkerReply]:
    assert pipe.poll(30), "the worker sent nothing (did it die?)"
    return REPLIES.decode(pipe.recv_bytes())


def _stand_in(monkeypatch) -> None:
    monkeypatch.setattr(executor, "ModelRunner", lambda config, device: SimpleNamespace())
    monkeypatch.setattr(executor, "kill_with_parent", lambda: None)
    # On a thread, as here, a worker cannot set signal handlers.
    monkeypatch.setattr(executor.signal, "signal", lambda *args: None)


def test_a_worker_destroys_its_process_group_when_the_executor_hangs_up(tmp_path, monkeypatch):
    """A group left to the interpreter's exit makes NCCL warn that work may still be pending (and
    a rank exiting so can block its peers): the worker tears the group down itself on EOF."""
    _stand_in(monkeypatch)
    threads = torch.get_num_threads()  # the worker sets its share of the cores
    ours, theirs = multiprocessing.Pipe()
    worker = threading.Thread(target=executor.run_worker, args=(CONFIG, 0, "cpu", f"file://{tmp_path}/init", theirs))
    worker.start()
    try:
        [ready] = _replies(ours)
        assert ready.error is None and dist.is_initialized()
        ours.close()
        worker.join(timeout=30)
        assert not worker.is_alive()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(threads)


def test_a_broken_collective_fails_the_start_not_the_first_request(tmp_path, monkeypatch):
    """NCCL connects its transports at the first collective; a worker makes one before it reports
    ready, so that a broken one (a /dev/shm too small, a wrong interface) fails the engine's start."""
    _stand_in(monkeypatch)

    def broken(*args, **kwargs):
        raise RuntimeError("NCCL error: unhandled system error")

    monkeypatch.setattr(executor.torch.distributed, "all_reduce", broken)
    ours, theirs = multiprocessing.Pipe()
    threads = torch.get_num_threads()
    worker = threading.Thread(target=executor.run_worker, args=(CONFIG, 0, "cpu", f"file://{tmp_path}/init", theirs))
    worker.start()
    try:
        [first] = _replies(ours)
        assert first.error == "RuntimeError: NCCL error: unhandled system error"
        # Having said why, the worker ends; the executor stops the engine.
        worker.join(timeout=30)
        assert not worker.is_alive() and not dist.is_initialized()
    finally:
        ours.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(threads)
