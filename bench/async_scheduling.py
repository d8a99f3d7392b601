"""--async-scheduling against synchronous scheduling: engine steps/s, side by side in one process.

Two engines on the same checkpoint, one with async scheduling, run the same greedy batch in
interleaved repetitions (the prefix cache is reset before each timed run). A step is one call
into the model; steps/s and tokens/s are reported as min and median over the repetitions, and
the outputs of both engines must be identical or the script fails.

    .venv/bin/python bench/async_scheduling.py [--model DIR] [--threads N] [--tensor-parallel-size N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.benchmarks.bench_model import bench_model_dir


def _count_steps(llm: LLM) -> list[int]:
    """Counts the engine's calls into the model (from whichever thread makes them)."""
    executor, counter = llm.engine.executor, [0]
    execute = executor.execute_model

    def counted(scheduler_output):
        counter[0] += not scheduler_output.is_empty
        return execute(scheduler_output)

    executor.execute_model = counted
    return counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: the 4-layer, hidden-256 bench llama)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model or bench_model_dir()

    engines = {mode: LLM(model_dir, async_scheduling=mode == "async", tensor_parallel_size=args.tensor_parallel_size)
               for mode in ("sync", "async")}
    steps = {mode: _count_steps(llm) for mode, llm in engines.items()}
    rng = random.Random(args.seed)
    vocab = engines["sync"].config.model.vocab_size
    prompts = [[rng.randrange(5, vocab) for _ in range(rng.randint(32, 256))] for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)

    results: dict[str, list[tuple[float, int, int]]] = {mode: [] for mode in engines}
    outputs = {}
    for llm in engines.values():
        llm.generate(prompts[:2], params)  # warm-up
    for _ in range(args.repeats):
        for mode, llm in engines.items():
            llm.reset_prefix_cache()
            before = steps[mode][0]
            start = time.perf_counter()
            generated = llm.generate(prompts, params)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in generated)
            results[mode].append((seconds, steps[mode][0] - before, tokens))
            outputs[mode] = [o.outputs[0].token_ids for o in generated]
    if outputs["async"] != outputs["sync"]:
        raise SystemExit("async scheduling changed the outputs")
    for llm in engines.values():
        llm.engine.shutdown()

    def rate(mode: str, index: int, pick) -> float:
        return pick([run[index] / run[0] for run in results[mode]])

    print(f"model: {model_dir}; {args.num_prompts} prompts x {args.new_tokens} new tokens, greedy; "
          f"torch threads: {args.threads}; TP {args.tensor_parallel_size}; {args.repeats} interleaved repeats")
    print("outputs: identical with and without async scheduling")
    print()
    print("| workload | async (min / median) | sync (min / median) | ratio (median) |")
    print("|---|---|---|---|")
    for name, index in (("steps/s", 1), ("tokens/s", 2)):
        print(f"| {name} | {rate('async', index, min):.1f} / {rate('async', index, statistics.median):.1f} | "
              f"{rate('sync', index, min):.1f} / {rate('sync', index, statistics.median):.1f} | "
              f"{rate('async', index, statistics.median) / rate('sync', index, statistics.median):.2f}x |")


if __name__ == "__main__":
    main()
