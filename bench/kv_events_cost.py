"""What KV-cache events cost a step: the engine with --kv-events-config against the same engine
without, side by side in one process, at a 0 % prefix-hit rate.

Every prompt is unique (random tokens), and the KV pool holds a fraction of what the run writes,
so that nearly every step stores new blocks and evicts cached ones: the most events per step a
workload without hits makes. The events are published over loopback with no subscriber, so the
cost measured is the engine's alone (recording, draining, handing over to the publisher thread,
and that thread's encoding and sending, which competes for the same cores). A step is one call
into the model; the step time is reported as min and median over interleaved repetitions, with
the ratio of the medians, and apart, the step loop's own time in handing the events over.

    .venv/bin/python bench/kv_events_cost.py [--model DIR] [--repeats N] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import socket
import statistics
import tempfile
import time

import torch

from kvpilot.runtime.config import EngineArgs, KVEventsConfig
from kvpilot.runtime.engine.core import EngineCore
from kvpilot.runtime.request import Request, SamplingParams

BLOCK_SIZE = 16
MAX_MODEL_LEN = 512


def _loopback_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def _engine(model_dir: str, num_blocks: int, max_num_seqs: int, events: bool) -> EngineCore:
    kv_events = KVEventsConfig(enable_kv_cache_events=True, endpoint=_loopback_address(),
                               replay_endpoint=_loopback_address()) if events else None
    return EngineCore(EngineArgs(model=model_dir, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                                 max_num_seqs=max_num_seqs, num_gpu_blocks_override=num_blocks,
                                 kv_events_config=kv_events).create_engine_config())


class _Timed:
    """Counts the engine's calls into the model and times its hand-over of the events."""

    def __init__(self, engine: EngineCore) -> None:
        self.steps = 0
        self.publish_seconds = 0.0
        execute, publish = engine.executor.execute_model, engine._publish_kv_events

        def counted(scheduler_output):
            self.steps += not scheduler_output.is_empty
            return execute(scheduler_output)

        def timed() -> None:
            start = time.perf_counter()
            publish()
            self.publish_seconds += time.perf_counter() - start

        engine.executor.execute_model = counted
        engine._publish_kv_events = timed


def _run(engine: EngineCore, prompts: list[list[int]], new_tokens: int, first_id: int) -> None:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for offset, prompt in enumerate(prompts):
        engine.add_request(Request(str(first_id + offset), prompt, params, max_model_len=MAX_MODEL_LEN))
    while engine.has_unfinished_requests():
        engine.step()


def _tiny_model() -> str:
    # tiny_model imports transformers, seconds a run given --model does without.
    from kvpilot.runtime.tiny_model import make_tiny_model

    return str(make_tiny_model(tempfile.mkdtemp(prefix="kvpilot-bench-")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: make-tiny-model's, whose steps are short)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model or _tiny_model()
    # Room for the running requests at full length, and a quarter of that again for cached blocks.
    num_blocks = args.max_num_seqs * (MAX_MODEL_LEN // BLOCK_SIZE) * 5 // 4
    engines = {mode: _engine(model_dir, num_blocks, args.max_num_seqs, events=mode == "on") for mode in ("on", "off")}
    timers = {mode: _Timed(engine) for mode, engine in engines.items()}
    rng = random.Random(args.seed)
    vocab = engines["on"].config.model.vocab_size
    request_ids = iter(range(0, 10**9, args.num_prompts))

    step_seconds: dict[str, list[float]] = {mode: [] for mode in engines}
    publish_per_step: list[float] = []
    for mode, engine in engines.items():
        _run(engine, [[rng.randrange(5, vocab) for _ in range(64)] for _ in range(4)], 2, next(request_ids))  # warm-up
    for repeat in range(args.repeats):
        # The same unique prompts for both sides, never seen before by either.
        prompts = [[rng.randrange(5, vocab) for _ in range(rng.randint(128, MAX_MODEL_LEN - args.new_tokens))]
                   for _ in range(args.num_prompts)]
        order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
        for mode in order:
            timer, first_id = timers[mode], next(request_ids)
            steps_before, publish_before = timer.steps, timer.publish_seconds
            start = time.perf_counter()
            _run(engines[mode], prompts, args.new_tokens, first_id)
            steps = timer.steps - steps_before
            step_seconds[mode].append((time.perf_counter() - start) / steps)
            if mode == "on":
                publish_per_step.append((timer.publish_seconds - publish_before) / steps)
    hit_tokens = engines["on"].kv_cache_manager.prefix_cache_hits
    for engine in engines.values():
        engine.shutdown()

    def ms(mode: str, pick) -> float:
        return pick(step_seconds[mode]) * 1e3

    print(f"model: {model_dir}; {args.num_prompts} unique prompts (128..{MAX_MODEL_LEN - args.new_tokens} tokens) "
          f"x {args.new_tokens} new tokens, greedy, max {args.max_num_seqs} running; {num_blocks} blocks of "
          f"{BLOCK_SIZE}; torch threads: {args.threads}; {args.repeats} interleaved repeats; "
          f"prefix-cache hits: {hit_tokens} tokens")
    print()
    print("| workload | step ms, events on (min / median) | step ms, events off (min / median) | ratio (median) |")
    print("|---|---|---|---|")
    print(f"| unique prompts, every step stores and evicts | {ms('on', min):.3f} / {ms('on', statistics.median):.3f} | "
          f"{ms('off', min):.3f} / {ms('off', statistics.median):.3f} | "
          f"{ms('on', statistics.median) / ms('off', statistics.median):.3f}x |")
    print()
    median_publish = statistics.median(publish_per_step)
    print(f"the step loop's own time in handing the events over (drain, queue): {median_publish * 1e6:.1f} us "
          f"per step (median), {median_publish * 1e3 / ms('off', statistics.median):.2%} of a step without events")


if __name__ == "__main__":
    main()
