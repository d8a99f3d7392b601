"""Throughput vs concurrency, offline: kvpilot against transformers `generate`, one request at a time
and batched, side by side in one run.

The same prompts and the same number of new tokens (greedy, EOS ignored) for every engine: at a
concurrency c, kvpilot's `LLM` holds at most c sequences in a step (`max_num_seqs=c`; continuous
batching refills a finished row at once), and transformers runs the prompts in left-padded batches
of c (static batching; c = 1 is one request at a time). Repetitions interleave every engine and
concurrency; each repetition draws prompts of its own, warm-ups use prompts that are never timed,
and kvpilot's prefix cache is reset before each timed run.

    .venv/bin/python bench/concurrency_throughput.py [--model DIR] [--output-dir DIR]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import _hf_generate  # noqa: E402

from kvpilot.runtime import LLM, SamplingParams  # noqa: E402
from kvpilot.runtime.argtypes import positive_int  # noqa: E402
from kvpilot.runtime.benchmarks.bench_model import DESCRIPTION, bench_model_dir  # noqa: E402
from kvpilot.runtime.benchmarks.plot import line_figure  # noqa: E402
from kvpilot.runtime.benchmarks.report import BenchReport, best_and_median, interleaved, markdown_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# The KV pool each engine gets: ample for 64 rows of 256 + 64 tokens on the bench model.
KV_CACHE_BYTES = 256 * 1024**2


def _prompts(rng: random.Random, count: int, vocab: int, longest: int) -> list[list[int]]:
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(min(32, longest), longest))] for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: the 4-layer, hidden-256 bench llama)")
    parser.add_argument("--num-prompts", type=positive_int, default=16)
    parser.add_argument("--new-tokens", type=positive_int, default=32)
    parser.add_argument("--concurrencies", type=lambda s: [positive_int(c) for c in s.split(",")], default=[1, 4, 16])
    parser.add_argument("--repetitions", type=positive_int, default=3)
    parser.add_argument("--threads", type=positive_int, default=2, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=ROOT / "bench/results/concurrency_throughput")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = BenchReport(__file__, args.output_dir, torch.get_num_threads(), ROOT)
    model_dir = args.model or bench_model_dir()

    engines = {c: LLM(model_dir, max_num_seqs=c, kv_cache_memory_bytes=KV_CACHE_BYTES) for c in args.concurrencies}
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    longest = min(256, engines[args.concurrencies[0]].config.scheduler.max_model_len - args.new_tokens)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    warm = _prompts(random.Random("warm-up"), 2, vocab, longest)
    for llm in engines.values():
        llm.generate(warm, params)
    _hf_generate(hf, warm, 4, pad_id=2)
    prompt_sets = [_prompts(random.Random(args.seed * 1000 + r), args.num_prompts, vocab, longest)
                   for r in range(args.repetitions)]
    tokens = args.num_prompts * args.new_tokens

    def kvpilot_run(c: int):
        def run(repetition: int) -> float:
            engines[c].reset_prefix_cache()
            start = time.perf_counter()
            outputs = engines[c].generate(prompt_sets[repetition], params)
            seconds = time.perf_counter() - start
            assert sum(len(o.outputs[0].token_ids) for o in outputs) == tokens
            return tokens / seconds
        return run

    def hf_run(c: int):
        def run(repetition: int) -> float:
            prompts = prompt_sets[repetition]
            start = time.perf_counter()
            made = sum(_hf_generate(hf, prompts[i:i + c], args.new_tokens, pad_id=2) for i in range(0, len(prompts), c))
            seconds = time.perf_counter() - start
            assert made == tokens
            return tokens / seconds
        return run

    runs = {}
    for c in args.concurrencies:
        runs[f"kvpilot c={c}"] = kvpilot_run(c)
        runs[f"transformers c={c}"] = hf_run(c)
    # transformers one request at a time is its c = 1 run, measured whatever the sweep.
    runs.setdefault("transformers c=1", hf_run(1))
    samples = interleaved(runs, args.repetitions)

    stats = {name: best_and_median(values, higher_is_better=True) for name, values in samples.items()}
    sequential = stats["transformers c=1"]
    rows = []
    for c in args.concurrencies:
        ours, batched = stats[f"kvpilot c={c}"], stats[f"transformers c={c}"]
        rows.append([c, f"{ours[0]:.0f} / {ours[1]:.0f}", f"{batched[0]:.0f} / {batched[1]:.0f}",
                     f"{ours[1] / batched[1]:.2f}x", f"{ours[1] / sequential[1]:.2f}x"])
    table = markdown_table(["concurrency", "kvpilot tok/s (best / median)", "transformers batched tok/s (best / median)",
                            "kvpilot / batched (medians)", "kvpilot / transformers one at a time (medians)"], rows)
    top = max(args.concurrencies)
    body = (f"Model: {model_dir if args.model else DESCRIPTION}, "
            f"float32; {args.num_prompts} prompts of 32..{longest} tokens x {args.new_tokens} new tokens, greedy, "
            f"{args.repetitions} interleaved repetitions. transformers one at a time: "
            f"{sequential[0]:.0f} / {sequential[1]:.0f} tok/s (best / median).\n\n{table}")
    figure = line_figure(
        report.output_path("throughput_vs_concurrency.png"),
        {"kvpilot (continuous batching)": [(c, stats[f"kvpilot c={c}"][1]) for c in args.concurrencies],
         "transformers generate, batched": [(c, stats[f"transformers c={c}"][1]) for c in args.concurrencies],
         "transformers generate, one at a time": [(c, sequential[1]) for c in args.concurrencies]},
        xlabel="concurrency (sequences at once)", ylabel="output tokens/s (median)",
        title="Offline throughput vs concurrency", log_x=True)
    ours_top, batched_top = stats[f"kvpilot c={top}"][1], stats[f"transformers c={top}"][1]
    headline = (f"offline at concurrency {top}: kvpilot {ours_top / batched_top:.2f}x transformers' batched generate "
                f"and {ours_top / sequential[1]:.1f}x transformers one request at a time (medians)")
    report.write(body, [figure], {"samples_tok_per_s": samples, "sequential_tok_per_s": sequential}, headline)


if __name__ == "__main__":
    main()
