"""Offline throughput: kvpilot's LLM against Hugging Face transformers, side by side in one process.

Two comparisons, each a ratio of wall-clock times measured here, one after the other:
1. decode-heavy batch: kvpilot `LLM.generate` vs transformers batched greedy `generate`
   (left-padded, KV cache on), same prompts, same number of new tokens;
2. shared-prefix prefill: kvpilot with prefix caching on vs off.

    .venv/bin/python bench/offline_throughput.py [--model DIR]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.tiny_model import make_tiny_model


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def _hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> int:
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=[], pad_token_id=pad_id)
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=mask, generation_config=config)
    return (out.shape[1] - width) * len(prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: a 4-layer, hidden-256 tiny llama)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=512, help="shared prefix of the prefix-caching workload")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    model_dir = args.model or str(make_tiny_model(
        tempfile.mkdtemp(prefix="kvpilot-bench-"), num_layers=4, hidden_size=256, num_heads=8,
        num_kv_heads=2, vocab_size=2048))

    rng = random.Random(args.seed)
    llm = LLM(model_dir)
    vocab = llm.config.model.vocab_size
    longest = min(256, llm.config.scheduler.max_model_len - args.new_tokens)
    prompts = [[rng.randrange(5, vocab) for _ in range(rng.randint(min(32, longest), longest))]
               for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)

    llm.generate(prompts[:2], params)  # warm-up
    outputs, kv_seconds = _timed(lambda: llm.generate(prompts, params))
    kv_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    _hf_generate(hf, prompts[:2], 4, pad_id=2)  # warm-up
    hf_tokens, hf_seconds = _timed(lambda: _hf_generate(hf, prompts, args.new_tokens, pad_id=2))

    prefix = [rng.randrange(5, vocab) for _ in range(args.prefix_len)]
    shared = [prefix + [rng.randrange(5, vocab) for _ in range(16)] for _ in range(args.num_prompts)]
    short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    timings = {}
    for caching in (False, True):
        engine = LLM(model_dir, enable_prefix_caching=caching)
        engine.generate(shared[:1], short)  # warm-up, and for caching=True the prefix is now cached
        _, timings[caching] = _timed(lambda: engine.generate(shared, short))

    print(f"model: {model_dir} ({llm.config.model.num_hidden_layers} layers, hidden {llm.config.model.hidden_size})")
    print(f"torch threads: {torch.get_num_threads()}")
    print()
    print("| workload | kvpilot | baseline | speed-up |")
    print("|---|---|---|---|")
    print(f"| {args.num_prompts} prompts x {args.new_tokens} new tokens (greedy) | "
          f"{kv_tokens / kv_seconds:.0f} tok/s | transformers generate: {hf_tokens / hf_seconds:.0f} tok/s | "
          f"{(kv_tokens / kv_seconds) / (hf_tokens / hf_seconds):.2f}x |")
    print(f"| {args.num_prompts} prompts sharing a {args.prefix_len}-token prefix, 4 new tokens | "
          f"prefix caching on: {timings[True]:.2f} s | off: {timings[False]:.2f} s | "
          f"{timings[False] / timings[True]:.2f}x |")


if __name__ == "__main__":
    main()
