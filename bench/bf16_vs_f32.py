"""bfloat16 against float32 on this CPU, side by side: prefill and decode throughput of one model in
both dtypes, offline (`LLM.generate`), the runs alternating between the two engines.

Prefill: prompts of random tokens, one token out, prompt tokens per second. Decode: batches of short
random prompts (8 tokens), `--new-tokens` out with EOS ignored, output tokens per second (the short
prefill is in the time). Every run draws prompts of its own, so no run hits another's cached
prefix. One engine is alive at a time (an idle second engine on the same cores slowed the other
3-15x here): each repetition loads the model in each dtype in turn (the order alternating), warms
every workload up once, times them all, and shuts the engine down. On a CPU without AVX-512 BF16 or AMX the bfloat16 engine is refused, and so is this script.

    .venv/bin/python bench/bf16_vs_f32.py [--model FILE.gguf|DIR] [--output-dir DIR]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.argtypes import positive_int
from kvpilot.runtime.benchmarks.plot import line_figure
from kvpilot.runtime.benchmarks.report import BenchReport, best_and_median, interleaved, markdown_table
from kvpilot.runtime.models.default_model import ensure_default_model

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("float32", "bfloat16")
DECODE_PROMPT_LEN = 8


def _prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a .gguf file or Hugging Face folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt-len", type=positive_int, default=512, help="tokens per prefill prompt")
    parser.add_argument("--prefill-prompts", type=positive_int, default=4)
    parser.add_argument("--batch-sizes", type=lambda s: [positive_int(n) for n in s.split(",")], default=[1, 4, 16],
                        help="decode batches, one point each")
    parser.add_argument("--new-tokens", type=positive_int, default=64)
    parser.add_argument("--repetitions", type=positive_int, default=3)
    parser.add_argument("--output-dir", type=Path, default=ROOT / "bench/results/bf16_vs_f32")
    args = parser.parse_args()
    report = BenchReport(__file__, args.output_dir, torch.get_num_threads(), ROOT)
    model = args.model or str(ensure_default_model())
    workloads = {"prefill": (args.prefill_prompts, args.prompt_len, 1)}
    workloads |= {f"decode, batch {b}": (b, DECODE_PROMPT_LEN, args.new_tokens) for b in args.batch_sizes}

    def tokens_per_second(llm: LLM, count: int, length: int, max_tokens: int, seed: int) -> float:
        prompts = _prompts(count, length, llm.config.model.vocab_size, seed)
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        return (count * length if max_tokens == 1 else sum(len(o.outputs[0].token_ids) for o in outputs)) / seconds

    def measure(dtype: str):
        def one(repetition: int) -> dict[str, float]:
            llm = LLM(model, dtype=dtype, max_model_len=args.prompt_len + args.new_tokens)
            try:
                for count, length, max_tokens in workloads.values():  # kernels built, buffers sized
                    tokens_per_second(llm, count, length, min(max_tokens, 4), seed=-1)
                return {name: tokens_per_second(llm, *shape, seed=1000 * repetition + point)
                        for point, (name, shape) in enumerate(workloads.items())}
            finally:
                llm.engine.shutdown()
        return one

    runs = interleaved({dtype: measure(dtype) for dtype in DTYPES}, args.repetitions)
    samples = {f"{dtype} {name}": [run[name] for run in runs[dtype]] for dtype in DTYPES for name in workloads}

    rows, decode_points = [], {dtype: [] for dtype in DTYPES}
    for name in workloads:
        medians = {}
        cells = [name]
        for dtype in DTYPES:
            best, medians[dtype] = best_and_median(samples[f"{dtype} {name}"], higher_is_better=True)
            cells.append(f"{best:.0f} / {medians[dtype]:.0f}")
            if name.startswith("decode"):
                decode_points[dtype].append((workloads[name][0], medians[dtype]))
        rows.append(cells + [f"{medians['bfloat16'] / medians['float32']:.2f}x"])
    unit = "prompt tok/s for prefill, output tok/s for decode"
    table = markdown_table(["workload", f"float32 ({unit}; best / median run)", "bfloat16 (best / median run)",
                            "bfloat16 / float32 (medians)"], rows)
    body = (f"Model: {model if args.model else 'SmolLM2-135M-Instruct (GGUF, the embedded default)'}, loaded in each "
            f"dtype for every repetition, one engine at a time. Prefill: {args.prefill_prompts} prompts of {args.prompt_len} random tokens, one token out. "
            f"Decode: batches of {DECODE_PROMPT_LEN}-token random prompts, {args.new_tokens} tokens out (EOS "
            f"ignored). {args.repetitions} runs per dtype and workload, alternating between the dtypes.\n\n{table}")
    figure = line_figure(report.output_path("decode_throughput.png"),
                         {dtype: points for dtype, points in decode_points.items()},
                         xlabel="decode batch (requests)", ylabel="output tok/s (median run)",
                         title="Decode throughput, bfloat16 and float32", log_x=True)
    prefill = {dtype: best_and_median(samples[f"{dtype} prefill"], True)[1] for dtype in DTYPES}
    last = f"decode, batch {args.batch_sizes[-1]}"
    decode = {dtype: best_and_median(samples[f"{dtype} {last}"], True)[1] for dtype in DTYPES}
    headline = (f"bfloat16 against float32: prefill {prefill['bfloat16'] / prefill['float32']:.2f}x, "
                f"{last} {decode['bfloat16'] / decode['float32']:.2f}x")
    report.write(body, [figure], {"tokens_per_second": samples}, headline)


if __name__ == "__main__":
    main()
