"""Packed weights against float weights: the same GGUF file served with `--quantization auto`
(its quantized matrices kept packed, quant_matmul) and `--quantization none` (dequantized to
float32 at load, F.linear), side by side in one process; a Hugging Face folder is run with
`--quantization int8` against `none`.

Greedy, random-token prompts, a fixed number of new tokens, one stream and a batch; the two
engines take turns, and min / median CPU and wall seconds are reported as in offline_throughput.

    PYTHONSAFEPATH=1 .venv/bin/python bench/packed_weights.py [--model FILE.gguf] [--batch 16]
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import _interleaved, _kvpilot_run, _random_prompts, _row, batched_workload_parser  # noqa: E402

from kvpilot.runtime import LLM, SamplingParams  # noqa: E402
from kvpilot.runtime.models.default_model import ensure_default_model  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = batched_workload_parser(__doc__.splitlines()[0], "prompts of the batched workload")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model or str(ensure_default_model())
    packed = "auto" if model.endswith(".gguf") else "int8"
    engines = {q: LLM(model, quantization=q, max_model_len=args.prompt_len + args.new_tokens + 8)
               for q in (packed, "none")}
    vocab = engines[packed].config.model.vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    print(f"{Path(model).name}, {args.threads} torch thread(s); ratios: none / {packed} (above 1: packed takes less)\n")
    print(f"| workload | --quantization {packed}: CPU s min / median | baseline | ratio by CPU, min / median "
          f"| ratio by wall |")
    print("|---|---|---|---|---|")
    for count in (1, args.batch):
        prompts = _random_prompts(rng, count, vocab, args.prompt_len)
        for llm in engines.values():
            llm.generate(_random_prompts(rng, count, vocab, args.prompt_len), params)  # warm-up
        seconds = _interleaved({q: _kvpilot_run(llm, prompts, params) for q, llm in engines.items()}, args.repeats)
        print(_row(f"{count} prompt(s) x {args.new_tokens} new tokens", seconds[packed], "--quantization none",
                   seconds["none"], lambda t: f"{t:.2f} s"))
    for llm in engines.values():
        llm.engine.shutdown()


if __name__ == "__main__":
    main()
