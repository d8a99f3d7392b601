"""The frontend and the EngineCore process together: real process, real ZMQ sockets."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.config import EngineArgs
from kvpilot.runtime.engine.async_llm import AsyncLLM, RequestRefusedError, SlowConsumerError
from kvpilot.runtime.engine.core_client import EngineDeadError
from kvpilot.runtime.engine.output_processor import FinishedRequestStats

PROMPTS = ["The quick brown fox", "To bake a simple loaf of bread", "A cache keeps", "In 1969"]


class RecordingStatLogger:
    def __init__(self) -> None:
        self.engine_stats = []
        self.finished: list[FinishedRequestStats] = []
        self.iterations: list[tuple[int, int]] = []

    def record_engine_stats(self, stats) -> None:
        self.engine_stats.append(stats)

    def record_finished_request(self, stats) -> None:
        self.finished.append(stats)

    def record_iteration(self, num_prompt_tokens, num_generation_tokens) -> None:
        self.iterations.append((num_prompt_tokens, num_generation_tokens))


@pytest.fixture(scope="module")
def loop():
    # One loop for the module: AsyncLLM binds its output hand-over to the loop it first runs on.
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    llm = AsyncLLM(EngineArgs(model=str(tiny_llama_dir), enable_prefix_caching=False, max_num_seqs=8).create_engine_config())
    yield llm
    llm.shutdown()


@pytest.fixture
def stat_logger(engine):
    recorder = RecordingStatLogger()
    engine.add_stat_logger(recorder)
    yield recorder
    engine.output_processor.stat_loggers.remove(recorder)


async def _collect(engine, prompt, params, request_id, **kwargs):
    return [out async for out in engine.generate(engine.encode(prompt), params, request_id, **kwargs)]


def _greedy(max_tokens=24, **extra):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **extra)


def test_streams_match_the_offline_engine(engine, loop, tiny_llama_dir, stat_logger):
    async def run_all():
        return await asyncio.gather(*(_collect(engine, p, _greedy(), f"r{i}") for i, p in enumerate(PROMPTS)))

    streams = loop.run_until_complete(run_all())
    offline = LLM(str(tiny_llama_dir)).generate(PROMPTS, _greedy())
    for stream, expected in zip(streams, offline):
        completion = expected.outputs[0]
        assert "".join(o.text for o in stream) == completion.text
        assert [t for o in stream for t in o.token_ids] == completion.token_ids
        assert stream[-1].finish_reason == "length" and stream[-1].num_output_tokens == 24
        assert all(o.finish_reason is None for o in stream[:-1])
    assert len(stat_logger.finished) == len(PROMPTS)
    for stats in stat_logger.finished:
        assert stats.finish_reason == "length" and stats.num_generation_tokens == 24
        assert stats.queue_time is not None and stats.time_to_first_token is not None
        assert len(stats.inter_token_latencies) == 23
        assert stats.e2e_latency >= stats.time_to_first_token
        assert stats.prefill_time == pytest.approx(stats.time_to_first_token - stats.queue_time)
        assert stats.decode_time == pytest.approx(sum(stats.inter_token_latencies))
        assert (stats.max_tokens, stats.n) == (24, 1)
    assert stat_logger.engine_stats[-1].num_running == 0
    # Each prompt counts once, in the step of its first token; every generated token once.
    assert sum(p for p, _ in stat_logger.iterations) == sum(len(engine.encode(p)) for p in PROMPTS)
    assert sum(g for _, g in stat_logger.iterations) == 24 * len(PROMPTS)


def test_n_fans_out_into_seeded_children(engine, loop):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=3, ignore_eos=True)
    outputs = loop.run_until_complete(_collect(engine, PROMPTS[0], params, "fan"))
    by_choice = {i: [t for o in outputs if o.index == i for t in o.token_ids] for i in range(3)}
    assert all(len(tokens) == 16 for tokens in by_choice.values())
    assert len({tuple(tokens) for tokens in by_choice.values()}) > 1
    # Child i is seeded with seed + i, so a lone request with that seed reproduces it.
    single = loop.run_until_complete(_collect(
        engine, PROMPTS[0], SamplingParams(max_tokens=16, temperature=1.0, seed=8, ignore_eos=True), "one"))
    assert [t for o in single for t in o.token_ids] == by_choice[1]


def test_stop_string_ends_the_request(engine, loop):
    full = "".join(o.text for o in loop.run_until_complete(_collect(engine, PROMPTS[1], _greedy(), "full")))
    stop = full[8:11]
    outputs = loop.run_until_complete(_collect(engine, PROMPTS[1], _greedy(stop=[stop]), "stopped"))
    assert "".join(o.text for o in outputs) == full[: full.index(stop)]
    assert outputs[-1].finish_reason == "stop" and outputs[-1].stop_reason == stop
    stats = loop.run_until_complete(_wait_idle(engine))
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0


async def _wait_idle(engine, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = await engine.get_stats()
        if stats.num_running == 0 and stats.num_waiting == 0 or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


def test_closing_a_stream_aborts_it_and_frees_its_blocks(engine, loop, stat_logger):
    async def read_a_little(request_id):
        stream = engine.generate(engine.encode(PROMPTS[2]), _greedy(max_tokens=400), request_id)
        async for output in stream:
            if output.num_output_tokens >= 3:
                break
        await stream.aclose()

    async def scenario():
        await asyncio.gather(*(read_a_little(f"gone{i}") for i in range(6)))
        return await _wait_idle(engine)

    stats = loop.run_until_complete(scenario())
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_cache_usage == 0.0
    assert not engine.output_processor.has_unfinished_requests()
    assert [s.finish_reason for s in stat_logger.finished] == ["abort"] * 6


def test_a_consumer_that_stops_reading_is_aborted_at_its_buffer_limit(engine, loop):
    async def scenario():
        stream = engine.generate(engine.encode(PROMPTS[2]), _greedy(max_tokens=400, n=2), "unread",
                                 max_buffered_outputs=8)
        await stream.__anext__()
        # Not reading: the engine must stop working for it long before its 800 tokens.
        stats = await _wait_idle(engine)
        read = [output async for output in _until_error(stream)]
        return stats, read

    stats, read = loop.run_until_complete(scenario())
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0
    assert not engine.output_processor.has_unfinished_requests()
    # What was buffered is still delivered, then the error, and nothing after it.
    assert 0 < len(read) - 1 <= 8 and isinstance(read[-1], SlowConsumerError)


async def _until_error(stream):
    try:
        async for output in stream:
            yield output
    except SlowConsumerError as error:
        yield error


def test_bad_input_is_refused_before_queueing(engine, loop):
    with pytest.raises(ValueError, match="prompt is empty"):
        loop.run_until_complete(engine.generate([], _greedy(), "empty").__anext__())
    with pytest.raises(ValueError, match="max_model_len"):
        loop.run_until_complete(
            engine.generate([5] * engine.max_model_len, _greedy(), "long").__anext__())
    assert not engine.output_processor.has_unfinished_requests()


def test_a_request_the_engine_refuses_raises_its_reason(engine, loop, monkeypatch):
    # The engine checks again what the frontend checked. Where they disagree (here the frontend's
    # check is skipped), the caller learns why, rather than seeing an empty "abort".
    monkeypatch.setattr(engine, "validate", lambda prompt_token_ids, params, resume_token_ids: None)
    with pytest.raises(RequestRefusedError, match="the engine refused the request: .*max_model_len"):
        loop.run_until_complete(engine.generate([5] * engine.max_model_len, _greedy(), "refused").__anext__())
    assert not engine.output_processor.has_unfinished_requests()


def test_duplicate_request_id_is_refused(engine, loop):
    async def scenario():
        first = engine.generate(engine.encode(PROMPTS[0]), _greedy(max_tokens=200), "dup")
        await first.__anext__()
        try:
            with pytest.raises(ValueError, match="already in use"):
                await engine.generate(engine.encode(PROMPTS[0]), _greedy(), "dup").__anext__()
        finally:
            await first.aclose()

    loop.run_until_complete(scenario())


def test_scheduling_policy_is_set_live(engine, loop):
    async def scenario():
        await engine.set_scheduling_policy("priority")
        assert (await engine.get_stats()).scheduling_policy == "priority"
        with pytest.raises(ValueError, match="lifo"):
            await engine.set_scheduling_policy("lifo")
        await engine.set_scheduling_policy("fcfs")
        return await engine.get_stats()

    assert loop.run_until_complete(scenario()).scheduling_policy == "fcfs"


def test_scrapers_at_once_share_one_engine_call(engine, loop, monkeypatch):
    calls = []
    ask = engine.engine_core.call_utility

    async def counted(name, *args):
        calls.append(name)
        return await ask(name, *args)

    monkeypatch.setattr(engine.engine_core, "call_utility", counted)

    async def scenario():
        quitter = asyncio.ensure_future(engine.scrape_stats())
        await asyncio.sleep(0)
        quitter.cancel()  # a scraper that gives up leaves the call to the others
        crowd = await asyncio.gather(*(engine.scrape_stats() for _ in range(32)))
        assert quitter.cancelled()
        assert len(calls) == 1 and all(stats is crowd[0] for stats in crowd)
        assert await engine.scrape_stats() is not crowd[0]  # the next scrape asks again
        assert len(calls) == 2

    loop.run_until_complete(scenario())


def test_engine_start_failure_reports_the_engine_error(tiny_llama_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((tiny_llama_dir / name).read_bytes())
    with pytest.raises(RuntimeError, match="safetensors"):
        AsyncLLM(EngineArgs(model=str(broken)).create_engine_config())


def test_engine_death_fails_requests_promptly(tiny_llama_dir):
    engine = AsyncLLM(EngineArgs(model=str(tiny_llama_dir)).create_engine_config())
    reasons = []
    engine.on_engine_dead(reasons.append)

    async def scenario():
        stream = engine.generate(engine.encode(PROMPTS[0]), _greedy(max_tokens=2000), "doomed")
        await stream.__anext__()
        os.kill(engine.engine_core._process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_drain(stream), timeout=10)
        with pytest.raises(EngineDeadError):
            await engine.generate(engine.encode(PROMPTS[0]), _greedy(), "after").__anext__()

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert engine.errored and len(reasons) == 1 and "code -9" in reasons[0]


async def _drain(stream):
    async for _ in stream:
        pass


def test_the_api_process_side_never_imports_torch():
    import subprocess
    import sys

    code = "import sys, kvpilot.runtime.engine.async_llm; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_reused_request_id_never_receives_the_old_requests_tokens(engine, loop):
    async def scenario():
        counts = []
        for _ in range(10):
            old = engine.generate(engine.encode(PROMPTS[0]), _greedy(max_tokens=400), "again")
            async for output in old:
                if output.num_output_tokens >= 3:
                    break
            await old.aclose()  # the engine may still send a step or two for the old request
            outputs = [o async for o in engine.generate(engine.encode(PROMPTS[1]), _greedy(max_tokens=2), "again")]
            counts.append((sum(len(o.token_ids) for o in outputs), outputs[-1].num_output_tokens))
        return counts

    assert loop.run_until_complete(scenario()) == [(2, 2)] * 10


def test_outputs_after_the_loop_closed_are_dropped_quietly(tiny_llama_dir, monkeypatch):
    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    engine = AsyncLLM(EngineArgs(model=str(tiny_llama_dir)).create_engine_config())
    loop = asyncio.new_event_loop()
    try:
        # The stream is left open: the engine keeps generating for a loop that is gone.
        stream = engine.generate(engine.encode(PROMPTS[0]), _greedy(max_tokens=2000), "orphan")
        loop.run_until_complete(stream.__anext__())
        loop.close()
        thread = engine.engine_core._output_thread
        thread.join(timeout=10)
        assert not thread.is_alive()
    finally:
        engine.shutdown()
    assert raised == []


_FRONTEND = """
import sys, time
from kvpilot.runtime.config import EngineArgs
from kvpilot.runtime.engine.core_client import EngineCoreClient
client = EngineCoreClient(EngineArgs(model=sys.argv[1]).create_engine_config(), lambda m: None, lambda r: None)
print(client._process.pid, flush=True)
time.sleep(600)
"""


def test_an_idle_engine_exits_when_its_frontend_is_killed(tiny_llama_dir):
    # SIGKILL runs no cleanup in the frontend: the engine, waiting for input, must notice alone.
    frontend = subprocess.Popen([sys.executable, "-c", _FRONTEND, str(tiny_llama_dir)], stdout=subprocess.PIPE, text=True)
    engine_pid = None
    try:
        engine_pid = int(frontend.stdout.readline())
        os.kill(frontend.pid, signal.SIGKILL)
        frontend.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _is_running(engine_pid):
            time.sleep(0.1)
        assert not _is_running(engine_pid), "the engine outlived its frontend"
    finally:
        frontend.kill()
        frontend.wait()
        if engine_pid is not None and _is_running(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)


def _is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
