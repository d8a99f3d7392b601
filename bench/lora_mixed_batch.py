"""A batch mixing LoRA adapters against the base model alone, on one engine.

Sixteen prompts at once (concurrency 16), greedy, a fixed number of new tokens: once every row
on the base model, once the rows spread evenly over four adapters of rank 16 on all seven linear
modules (the costliest adapters the default --max-lora-rank takes). The adapters are random PEFT
folders written for the model's shapes. The two workloads take turns on the same engine (a second
engine alive on the same cores slows the timed one); min / median CPU and wall seconds are
reported as in offline_throughput, and the ratio is base / mixed (0.8 and above: the target).

    PYTHONSAFEPATH=1 .venv/bin/python bench/lora_mixed_batch.py [--model FILE.gguf] [--batch 16]
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import _interleaved, _random_prompts, _row, batched_workload_parser  # noqa: E402

from kvpilot.runtime import LLM, SamplingParams  # noqa: E402
from kvpilot.runtime.config import ModelConfig  # noqa: E402
from kvpilot.runtime.lora.adapter import ADAPTABLE_MODULES, CONFIG_FILE, WEIGHTS_FILE, module_shapes  # noqa: E402
from kvpilot.runtime.lora.request import LoRARequest  # noqa: E402
from kvpilot.runtime.models.default_model import ensure_default_model  # noqa: E402


def write_random_adapter(folder: Path, model: ModelConfig, rank: int, seed: int) -> Path:
    """A PEFT LoRA folder for every decoder layer's seven linear modules, with random A and B."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model.num_hidden_layers):
        for module, (out_features, in_features) in module_shapes(model).items():
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, folder / WEIGHTS_FILE)
    (folder / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                  "target_modules": list(ADAPTABLE_MODULES)}))
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = batched_workload_parser(__doc__.splitlines()[0], "prompts run at once")
    parser.add_argument("--adapters", type=int, default=4, help="adapters the batch's rows are spread over")
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model or str(ensure_default_model())
    llm = LLM(model, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
              max_num_seqs=args.batch, max_model_len=args.prompt_len + args.new_tokens + 8)
    with tempfile.TemporaryDirectory() as scratch:
        loras = [LoRARequest(f"adapter-{i}", i + 1, str(write_random_adapter(Path(scratch) / str(i), llm.config.model,
                                                                               args.rank, seed=i)))
                 for i in range(args.adapters)]
        rng = random.Random(0)
        vocab = llm.config.model.vocab_size
        prompts = _random_prompts(rng, args.batch, vocab, args.prompt_len)
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
        mixed = [loras[i % len(loras)] for i in range(args.batch)]

        def run(lora_requests):
            def once():
                llm.reset_prefix_cache()
                return llm.generate(prompts, params, lora_request=lora_requests)
            return once

        sides = {"mixed": run(mixed), "base": run(None)}
        for once in sides.values():
            once()  # warm-up: loads the adapters into their slots, builds the kernels
        seconds = _interleaved(sides, args.repeats)
    llm.engine.shutdown()
    print(f"{Path(model).name}, {args.threads} torch thread(s); ratios: base / mixed (above 0.8: the target)\n")
    print("| workload | mixed adapters: CPU s min / median | baseline | ratio by CPU, min / median | ratio by wall |")
    print("|---|---|---|---|---|")
    print(_row(f"{args.batch} prompts x {args.new_tokens} new tokens, {args.adapters} adapters of rank {args.rank}",
               seconds["mixed"], "base model alone", seconds["base"], lambda t: f"{t:.2f} s"))


if __name__ == "__main__":
    main()
