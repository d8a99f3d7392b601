"""Offline throughput: kvpilot's LLM against Hugging Face transformers, side by side in one process.

For each model (default: the 4-layer, hidden-256 bench model, then SmolLM2-135M-Instruct, the
embedded default; `--model DIR` runs that one only):
1. kvpilot `LLM.generate` vs transformers batched greedy `generate` (left-padded, KV cache on),
   same checkpoint, float32, same prompts, same number of new tokens;
2. kvpilot's decode step (every request decoding) vs the GEMM-only work of the same shapes: the
   model's own weight matrices multiplied by activations of that batch, nothing else;
3. prefix caching on at 0 % hits vs off, on the same unique prompts;
4. a shared-prefix prefill, prefix caching on vs off.

Every side warms up on prompts it is not timed on; the prefix cache is reset before every timed
run; repetitions of the sides are interleaved, and min and median are reported.

    .venv/bin/python bench/offline_throughput.py [--model DIR] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.benchmarks.bench_model import bench_model_dir
from kvpilot.runtime.layers.linear import ColumnParallelLinear, ParallelLMHead, RowParallelLinear
from kvpilot.runtime.request import Request


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def _hf_model(model: str):
    # transformers is imported where it is used: lora_mixed_batch.py and packed_weights.py import
    # this module's helpers and never run it.
    from transformers import AutoModelForCausalLM

    path = Path(model)
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def _hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> int:
    from transformers import GenerationConfig  # where it is used, as in _hf_model

    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=[], pad_token_id=pad_id)
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=mask, generation_config=config)
    return (out.shape[1] - width) * len(prompts)


def _random_prompts(rng: random.Random, count: int, vocab: int, longest: int) -> list[list[int]]:
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(min(32, longest), longest))] for _ in range(count)]


def _min_median(samples: list[float]) -> tuple[float, float]:
    return min(samples), statistics.median(samples)


def _interleaved(sides: dict, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Wall-clock and CPU seconds (this process) per run of each side, the sides taking turns.

    On a shared machine the CPU time is the steadier clock: it leaves out the time the process
    waited for a core. With one torch thread it is the work done."""
    seconds = {name: {"cpu": [], "wall": []} for name in sides}
    for _ in range(repeats):
        for name, run in sides.items():
            cpu = time.process_time()
            _, wall = _timed(run)
            seconds[name]["cpu"].append(time.process_time() - cpu)
            seconds[name]["wall"].append(wall)
    return seconds


def batched_workload_parser(description: str, batch_help: str) -> argparse.ArgumentParser:
    """The flags of a one-engine bench that runs one prompt, then a batch (packed weights, LoRA)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", help="a .gguf file or HF folder (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--batch", type=int, default=16, help=batch_help)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (torch.set_num_threads)")
    return parser


def _row(workload: str, ours: dict, baseline: str, theirs: dict, show) -> str:
    """A table row: both sides by CPU time (min / median, through `show`), then the ratios
    baseline / kvpilot by CPU time and by wall clock (above 1: kvpilot takes less)."""
    cells = [f"{show(min(side['cpu']))} / {show(statistics.median(side['cpu']))}" for side in (ours, theirs)]
    ratios = []
    for clock in ("cpu", "wall"):
        (ours_min, ours_med), (theirs_min, theirs_med) = _min_median(ours[clock]), _min_median(theirs[clock])
        ratios.append(f"{theirs_min / ours_min:.3f}x / {theirs_med / ours_med:.3f}x")
    return f"| {workload} | {cells[0]} | {baseline}: {cells[1]} | {ratios[0]} | {ratios[1]} |"


def _kvpilot_run(llm: LLM, prompts, params):
    def run():
        llm.reset_prefix_cache()
        return llm.generate(prompts, params)
    return run


def _decode_vs_gemm(llm: LLM, prompts: list[list[int]], steps: int) -> tuple[dict, dict]:
    """Seconds per engine step with every prompt decoding, and per GEMM-only pass of that batch."""
    engine = llm.engine
    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(Request(f"decode-{i}", ids, params, eos_token_id=None,
                                   max_model_len=llm.config.scheduler.max_model_len))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    engine.step()  # the first step with every request decoding

    model = engine.executor.model
    # Each layer's own matmul: F.linear on float weights, quant_matmul on packed ones.
    layers = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead))]
    inputs = [torch.randn(len(prompts), m.input_features, dtype=llm.config.model.torch_dtype) for m in layers]

    @torch.inference_mode()
    def gemm_only():
        for x, layer in zip(inputs, layers):
            layer.matmul(x)

    timings = _interleaved({"step": engine.step, "gemm": gemm_only}, steps)
    engine.abort_requests([f"decode-{i}" for i in range(len(prompts))])
    return timings["step"], timings["gemm"]


def _bench_model(model_dir: str, args, rng: random.Random) -> list[str]:
    kv_on = LLM(model_dir, enable_prefix_caching=True)
    kv_off = LLM(model_dir, enable_prefix_caching=False)
    config = kv_on.config
    name = f"{Path(model_dir).name} ({config.model.num_hidden_layers} layers, hidden {config.model.hidden_size})"
    vocab = config.model.vocab_size
    longest = min(256, config.scheduler.max_model_len - args.new_tokens)
    prompts = _random_prompts(rng, args.num_prompts, vocab, longest)
    warmup = _random_prompts(rng, args.num_prompts, vocab, longest)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    hf = _hf_model(model_dir)

    for llm in (kv_on, kv_off):
        llm.generate(warmup, params)
    _hf_generate(hf, warmup, args.new_tokens, pad_id=2)
    seconds = _interleaved({
        "on": _kvpilot_run(kv_on, prompts, params),
        "off": _kvpilot_run(kv_off, prompts, params),
        "hf": lambda: _hf_generate(hf, prompts, args.new_tokens, pad_id=2),
    }, args.repeats)
    del hf
    tokens = args.num_prompts * args.new_tokens
    step, gemm = _decode_vs_gemm(kv_on, prompts, args.decode_steps)

    prefix = [rng.randrange(5, vocab) for _ in range(min(args.prefix_len, config.scheduler.max_model_len - 20))]
    shared = [prefix + [rng.randrange(5, vocab) for _ in range(16)] for _ in range(args.num_prompts)]
    short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    shared_seconds = _interleaved({"on": _kvpilot_run(kv_on, shared, short),
                                   "off": _kvpilot_run(kv_off, shared, short)}, args.repeats)
    for llm in (kv_on, kv_off):
        llm.engine.shutdown()

    batch = f"{args.num_prompts} prompts x {args.new_tokens} new tokens"
    tok_s, ms, s = (lambda t: f"{tokens / t:.0f} tok/s"), (lambda t: f"{t * 1e3:.2f} ms"), (lambda t: f"{t:.3f} s")
    return [
        _row(f"{name}: {batch}, greedy", seconds["on"], "transformers generate", seconds["hf"], tok_s),
        _row(f"{name}: decode step, {args.num_prompts} running", step, "GEMM-only, same shapes", gemm, ms),
        _row(f"{name}: {batch}, prefix caching on at 0 % hits", seconds["on"], "caching off", seconds["off"], s),
        _row(f"{name}: {args.num_prompts} prompts sharing a {len(prefix)}-token prefix, 4 new tokens, caching on",
             shared_seconds["on"], "caching off", shared_seconds["off"], s),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder or .gguf file (default: the bench model, then SmolLM2-135M)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=512, help="shared prefix of the prefix-caching workload")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each side, interleaved")
    parser.add_argument("--decode-steps", type=int, default=30, help="timed decode steps (and GEMM-only passes)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (torch.set_num_threads)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    if args.model:
        models = [args.model]
    else:
        # Imported here: only the default run fetches the real model.
        from kvpilot.runtime.models.default_model import ensure_default_model

        models = [bench_model_dir(), str(ensure_default_model())]

    print(f"torch threads: {torch.get_num_threads()}; float32; {args.repeats} interleaved runs per side "
          f"({args.decode_steps} for the decode step)")
    print()
    print("| workload | kvpilot (CPU time, min / median) | baseline (same) | baseline / kvpilot, CPU time "
          "(min / median) | same, wall clock |")
    print("|---|---|---|---|---|")
    for model in models:
        for row in _bench_model(model, args, rng):
            print(row, flush=True)


if __name__ == "__main__":
    main()
