"""A trained model: SmolLM2-135M-Instruct (GGUF) on kvpilot and on transformers, side by side.

Both load the same GGUF file (the embedded default of `kvpilot serve`, fetched once into the user's
cache; `--model` takes another .gguf file or Hugging Face folder). For float32 and bfloat16 (on a CPU
with BF16 instructions; the report says where bfloat16 did not run, and why): the
chat prompts one at a time (sequential), then all together (batched; transformers left-pads them),
greedy, a fixed number of new tokens.

    PYTHONSAFEPATH=1 .venv/bin/python bench/smollm2_throughput.py [--num-prompts 8] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import _hf_generate, _timed  # noqa: E402

from kvpilot.runtime import LLM, SamplingParams  # noqa: E402
from kvpilot.runtime.cpu_bf16 import bfloat16_unsupported, cpu_flags  # noqa: E402
from kvpilot.runtime.models.default_model import ensure_default_model  # noqa: E402
from kvpilot.runtime.models.tokenizer_loader import load_tokenizer  # noqa: E402
from kvpilot.runtime.server.chat_template import ChatTemplate, ChatTemplateError  # noqa: E402

TOPICS = ["the sea", "Paris", "a robot", "autumn", "coffee", "mountains", "the moon", "a library",
          "trains", "rain", "chess", "gardens", "bread", "winter", "music", "rivers"]


def _hf_model(model: str, dtype: str):
    path = Path(model)
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype))
    return AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))


def _prompts(model: str, count: int) -> list[list[int]]:
    tokenizer, tokenizer_config = load_tokenizer(model)
    template = ChatTemplate(tokenizer_config)
    prompts = []
    for topic in TOPICS[:count]:
        text = f"Write two sentences about {topic}."
        try:
            text = template.render([{"role": "user", "content": text}])
        except ChatTemplateError:
            pass  # a test checkpoint without a chat template: the plain request
        prompts.append(tokenizer.encode(text, add_special_tokens=False).ids)
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a .gguf file or Hugging Face folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    model = args.model or str(ensure_default_model())
    prompts = _prompts(model, args.num_prompts)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    total = args.new_tokens * len(prompts)

    print(f"model: {model}; {len(prompts)} prompts ({min(map(len, prompts))}..{max(map(len, prompts))} "
          f"tokens) x {args.new_tokens} new tokens, greedy; torch threads: {torch.get_num_threads()}")
    print()
    print("| workload | kvpilot | transformers | speed-up |")
    print("|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        if dtype == "bfloat16" and not torch.cuda.is_available() and (reason := bfloat16_unsupported(cpu_flags())):
            print(f"| bfloat16 | not run: {reason} | | |")
            continue
        llm = LLM(model, dtype=dtype)
        hf = _hf_model(model, dtype).eval()
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))  # warm-up
        _hf_generate(hf, prompts[:1], 4, pad_id=2)
        runs = {
            "sequential": (lambda: [llm.generate([p], params) for p in prompts],
                           lambda: [_hf_generate(hf, [p], args.new_tokens, pad_id=2) for p in prompts]),
            "batched": (lambda: llm.generate(prompts, params),
                        lambda: _hf_generate(hf, prompts, args.new_tokens, pad_id=2)),
        }
        for mode, (ours, theirs) in runs.items():
            _, kv_seconds = _timed(ours)
            _, hf_seconds = _timed(theirs)
            print(f"| {dtype}, {mode} | {total / kv_seconds:.0f} tok/s | {total / hf_seconds:.0f} tok/s | "
                  f"{hf_seconds / kv_seconds:.2f}x |", flush=True)
        llm.engine.shutdown()
        del llm, hf


if __name__ == "__main__":
    main()
