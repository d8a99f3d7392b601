"""Scheduler overhead per running request per step: this tree against a baseline revision, side by side.

A pure-scheduler loop, no model: N requests decode together (prompts of 100 tokens, block size 16,
prefix caching on, stop token ids set, no EOS in sight), and a fake runner samples one token for
every request whose tokens are all computed. Only `schedule()` and `update_from_output()` are
timed, wall clock and CPU time; the figure is their cost divided by running requests and steps.
Apart, the CPU time of encoding each step's outputs and dropping them, the engine process's
output thread's work.
Each side runs as its engine process would: where the tree's engine freezes its start-up heap out
of the cyclic GC, the bench does too once the block pool exists, before any request is added.
The baseline is another revision's runtime (default: the commit before the bookkeeping work),
taken out of git into a temporary folder; each side runs in its own subprocess per repeat and the
repetitions interleave, each side first every other time.

    .venv/bin/python bench/scheduler_overhead.py [--baseline REV] [--running 64 256 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

# main before issue 11's scheduler work: the issue's 4.7 us @256 and 6.8 us @1024 were measured on it.
DEFAULT_BASELINE = "bb345a35f0a2baf7bf102cca2128ac2b1264cbb2"
PROMPT_LEN = 100
BLOCK_SIZE = 16


def _freeze_like_the_engine() -> str:
    """Freeze the start-up heap where the side's engine process does, and say whether it did."""
    try:
        from kvpilot.runtime.engine.core_process import freeze_startup_heap
    except ImportError:
        return "no"
    freeze_startup_heap()
    return "yes"


def measure(num_running: int, num_steps: int) -> dict[str, float | str]:
    """Seconds of scheduler work per running request per decode step, wall clock and CPU time
    (run inside a side's process)."""
    from kvpilot.runtime.config import SchedulerConfig
    from kvpilot.runtime.core.kv_cache_manager import KVCacheManager
    from kvpilot.runtime.core.sched.output import ModelRunnerOutput
    from kvpilot.runtime.core.sched.scheduler import Scheduler
    from kvpilot.runtime.engine.messages import EngineCoreOutputs
    from kvpilot.runtime.request import Request, SamplingParams

    max_len = PROMPT_LEN + num_steps + 64
    blocks = num_running * -(-max_len // BLOCK_SIZE) + 1
    config = SchedulerConfig(max_num_seqs=num_running, max_num_batched_tokens=max(8192, num_running),
                             max_model_len=max_len)
    scheduler = Scheduler(config, KVCacheManager(blocks, BLOCK_SIZE, enable_caching=True))
    params = SamplingParams(max_tokens=num_steps + 32, temperature=0, stop_token_ids=[3, 4])
    for i in range(num_running):
        prompt = [5 + (i * 7919 + j * 31) % 30000 for j in range(PROMPT_LEN)]
        scheduler.add_request(Request(f"req-{i}", prompt, params, eos_token_id=2, arrival_time=float(i),
                                      max_model_len=max_len))

    # The engine process builds its block pool at start-up, then (on trees that do) freezes it
    # out of the cyclic GC before any request arrives.
    frozen = _freeze_like_the_engine()

    # The runner's view of each row: [tokens it holds, tokens computed]. Shared by both revisions'
    # SchedulerOutputs, which agree on new requests, counts and removed rows.
    rows: dict[str, list[int]] = {}

    def run(out) -> ModelRunnerOutput:
        for req_id in [*out.finished_req_ids, *out.preempted_req_ids]:
            rows.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            rows[new.req_id] = [len(new.token_ids), new.num_computed_tokens]
        req_ids, sampled = [], []
        for req_id, num in out.num_scheduled_tokens.items():
            row = rows[req_id]
            row[1] += num
            tokens = []
            if row[1] == row[0]:
                row[0] += 1
                tokens = [5 + (row[0] * 131 + len(req_ids)) % 30000]
            req_ids.append(req_id)
            sampled.append(tokens)
        return ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids))

    # Until every prompt is in: then each step is one decode token per request.
    while scheduler.num_waiting or any(row[1] < row[0] - 1 for row in rows.values()) or not rows:
        out = scheduler.schedule()
        scheduler.update_from_output(out, run(out))
    wall = cpu = encode_cpu = 0.0
    encoder = msgspec.msgpack.Encoder()
    for _ in range(num_steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        out = scheduler.schedule()
        wall += time.perf_counter() - start
        cpu += time.process_time() - start_cpu
        runner_output = run(out)
        start, start_cpu = time.perf_counter(), time.process_time()
        outputs = scheduler.update_from_output(out, runner_output)
        wall += time.perf_counter() - start
        cpu += time.process_time() - start_cpu
        if len(out.num_scheduled_tokens) != num_running or len(outputs) != num_running:
            raise RuntimeError(f"expected {num_running} running requests, {len(out.num_scheduled_tokens)} ran")
        # The engine process's output thread: the step's outputs as one message for the socket,
        # then dropped (their deallocation is that thread's work too, while the model runs).
        start_cpu = time.process_time()
        encoder.encode(EngineCoreOutputs(outputs=outputs))
        del outputs
        encode_cpu += time.process_time() - start_cpu
    per = num_steps * num_running
    return {"wall": wall / per, "cpu": cpu / per, "encode_cpu": encode_cpu / per, "frozen": frozen}


def _run_side(env: dict[str, str] | None, running: list[int], steps: int) -> dict[int, dict]:
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from scheduler_overhead import measure; "
            "print(json.dumps({n: measure(n, int(sys.argv[2])) for n in map(int, sys.argv[3:])}))")
    result = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(steps), *map(str, running)],
                            env=env, check=True, capture_output=True, text=True)
    return {int(n): s for n, s in json.loads(result.stdout).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help="git revision to compare with")
    parser.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per measurement")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    # Not at the top: each side's process imports this module, the baseline's with a kvpilot.runtime
    # that may predate the helper.
    from kvpilot.runtime.benchmarks.revisions import REPO, baseline_env, check_imports_from, source_tree

    with tempfile.TemporaryDirectory(prefix="kvpilot-sched-baseline-") as tmp:
        scheduler = "kvpilot.runtime.core.sched.scheduler"
        baseline = baseline_env(source_tree(args.baseline, ("runtime",), Path(tmp)), scheduler)
        check_imports_from(scheduler, REPO)
        sides = {"this tree": None, "baseline": baseline}
        runs: dict[str, list[dict[int, dict]]] = {side: [] for side in sides}
        for repeat in range(args.repeats):
            # Each side goes first every other repeat, so neither always runs on a warmer machine.
            for side in (sides if repeat % 2 else reversed(sides)):
                runs[side].append(_run_side(sides[side], args.running, args.steps))

    def us(side: str, n: int, clock: str, pick) -> float:
        return pick([run[n][clock] for run in runs[side]]) * 1e6

    median = statistics.median
    frozen = {side: runs[side][0][args.running[0]]["frozen"] for side in runs}
    print(f"baseline: {args.baseline}; {args.steps} decode steps, {args.repeats} interleaved repeats, "
          f"block size {BLOCK_SIZE}, prompts of {PROMPT_LEN} tokens, prefix caching on; one process per side "
          f"per repeat; start-up heap frozen out of the GC: this tree {frozen['this tree']}, "
          f"baseline {frozen['baseline']}; load average {os.getloadavg()[0]:.1f} at the end")
    print()
    print("| workload | this tree (min / median) | baseline (min / median) | speed-up (median) |")
    print("|---|---|---|---|")
    for clock, name in (("cpu", "CPU time"), ("wall", "wall clock")):
        for n in args.running:
            mine, base = us("this tree", n, clock, median), us("baseline", n, clock, median)
            print(f"| {n} running, us per request per step, {name} | {us('this tree', n, clock, min):.2f} / "
                  f"{mine:.2f} | {us('baseline', n, clock, min):.2f} / {base:.2f} | {base / mine:.2f}x |")
    for n in args.running:
        mine, base = us("this tree", n, "encode_cpu", median), us("baseline", n, "encode_cpu", median)
        print(f"| {n} running, us per request per step to encode and drop the step's outputs (output thread), CPU time | "
              f"{us('this tree', n, 'encode_cpu', min):.2f} / {mine:.2f} | "
              f"{us('baseline', n, 'encode_cpu', min):.2f} / {base:.2f} | {base / mine:.2f}x |")
    low, high = min(args.running), max(args.running)
    for clock, name in (("cpu", "CPU time"), ("wall", "wall clock")):
        print(f"| cost at {high} / cost at {low} running, {name} (min; median) | "
              f"{us('this tree', high, clock, min) / us('this tree', low, clock, min):.2f}x; "
              f"{us('this tree', high, clock, median) / us('this tree', low, clock, median):.2f}x | "
              f"{us('baseline', high, clock, min) / us('baseline', low, clock, min):.2f}x; "
              f"{us('baseline', high, clock, median) / us('baseline', low, clock, median):.2f}x | |")


if __name__ == "__main__":
    main()
