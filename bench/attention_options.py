"""Paged attention on a CPU: the kept backend against the other ways of computing it, side by side.

One layer of the bench model's shapes (8 query heads, 2 KV heads, head_dim 32, blocks of 16):
a decode step of `--num-reqs` requests with contexts of 96..320 tokens, and a step of prefill
chunks (64 new tokens each after 0..192 cached). Each option writes nothing and reads the same
cache; all are checked against the kept backend before timing. Kept: the `cpu` backend (the C
kernel in kernels/cpu/, reading the pages in place); the torch backend is the first option.
Runs are interleaved, min and median of `--repeats` runs of `--calls` calls each are reported in
CPU time of this process (steadier than the wall clock on a shared machine; the work done, with
one thread), the same ratios in wall-clock time beside them. The torch backend plans its step in
every call here (in the engine: once per step, for every layer).

    .venv/bin/python bench/attention_options.py [--num-reqs 48] [--threads 1] [--baseline REV] [--cold]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kvpilot.kernels.cpu.build import load_source
from kvpilot.kernels.cpu.paged_attention import bind
from kvpilot.runtime.benchmarks.revisions import file_at
from kvpilot.runtime.core.sched.output import NewRequestData
from kvpilot.runtime.layers.attention import CpuPagedAttention, TorchPagedAttention
from kvpilot.runtime.request import SamplingParams
from kvpilot.runtime.worker.input_batch import InputBatch
from kvpilot.runtime.worker.step_inputs import StepBuffers, StepInputs

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 32, 16


def _step(rng: np.random.Generator, num_reqs: int, cached: tuple[int, int], new_tokens: int):
    """A step of `num_reqs` requests with `cached` (low, high) tokens in the cache, `new_tokens` each."""
    context = rng.integers(*cached, size=num_reqs)
    max_len = int(context.max()) + new_tokens
    max_blocks = -(-max_len // BLOCK_SIZE)
    batch = InputBatch(num_reqs, max_len, max_blocks, torch.device("cpu"), vocab_size=32000)
    pages = rng.permutation(num_reqs * max_blocks) + 1
    for i, cached_tokens in enumerate(context):
        total = int(cached_tokens) + new_tokens
        batch.add_request(NewRequestData(
            req_id=str(i), token_ids=[1] * total, num_prompt_tokens=total, sampling_params=SamplingParams(),
            block_ids=pages[i * max_blocks : i * max_blocks + -(-total // BLOCK_SIZE)].tolist(),
            num_computed_tokens=int(cached_tokens)))
    step = StepInputs.build(batch, {str(i): new_tokens for i in range(num_reqs)}, BLOCK_SIZE)
    buffers = StepBuffers(step.num_tokens, num_reqs, max_blocks, torch.device("cpu"))
    _, _, metadata = buffers.load(step)
    cache = torch.randn(2, num_reqs * max_blocks + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    q = torch.randn(step.num_tokens, HEADS, HEAD_DIM)
    return q, cache, metadata


def _backend_call(backend):
    def attend(q, cache, metadata, scale):
        metadata.backend_plan = None  # plan once per call, as once per step
        empty = torch.empty(0, KV_HEADS, HEAD_DIM)
        return backend.forward(q, empty, empty, cache, _no_writes(metadata), scale)
    return attend


kept = _backend_call(CpuPagedAttention())
torch_backend = _backend_call(TorchPagedAttention())


def _no_writes(metadata):
    metadata.slot_mapping = metadata.slot_mapping[:0]
    return metadata


def _padded_context(cache, metadata, gather):
    keys, values = gather(cache[0], metadata.block_tables), gather(cache[1], metadata.block_tables)
    num_reqs = metadata.block_tables.shape[0]
    return keys.view(num_reqs, -1, KV_HEADS, HEAD_DIM), values.view(num_reqs, -1, KV_HEADS, HEAD_DIM)


def _advanced_index(table, block_tables):
    return table[block_tables]


def _index_select(table, block_tables):
    return table.index_select(0, block_tables.flatten())


def _decode_mask(metadata, num_keys):
    return torch.arange(num_keys)[None, :] < metadata.seq_lens[:, None]


def _sdpa_gqa(q, cache, metadata, scale, gather):
    keys, values = _padded_context(cache, metadata, gather)
    mask = _decode_mask(metadata, keys.shape[1])[:, None, None, :]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(2)


def advanced_index_sdpa_gqa(q, cache, metadata, scale):
    """The backend before: `key_cache[block_tables]`, SDPA repeating K/V per query head."""
    return _sdpa_gqa(q, cache, metadata, scale, _advanced_index)


def index_select_sdpa_gqa(q, cache, metadata, scale):
    return _sdpa_gqa(q, cache, metadata, scale, _index_select)


def index_select_matmul(q, cache, metadata, scale):
    """Scores, masked softmax and the weighted sum as explicit batched matmuls (grouped queries)."""
    keys, values = _padded_context(cache, metadata, _index_select)
    num_reqs = keys.shape[0]
    grouped = q.view(num_reqs, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    scores = torch.matmul(grouped, keys.permute(0, 2, 3, 1)) * scale
    scores.masked_fill_(~_decode_mask(metadata, keys.shape[1])[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, -1), values.transpose(1, 2)).view(num_reqs, HEADS, HEAD_DIM)


def blockwise_online_softmax(q, cache, metadata, scale):
    """One block-table column at a time, merging partial softmaxes (no padded context at all)."""
    num_reqs = q.shape[0]
    grouped = q.view(num_reqs, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    running_max = torch.full((num_reqs, KV_HEADS, HEADS // KV_HEADS, 1), float("-inf"))
    running_sum = torch.zeros_like(running_max)
    acc = torch.zeros_like(grouped)
    positions = torch.arange(BLOCK_SIZE)
    for column in range(metadata.block_tables.shape[1]):
        pages = metadata.block_tables[:, column]
        keys = cache[0].index_select(0, pages).permute(0, 2, 3, 1)  # [reqs, kv_heads, dim, block]
        values = cache[1].index_select(0, pages).transpose(1, 2)    # [reqs, kv_heads, block, dim]
        scores = torch.matmul(grouped, keys) * scale
        visible = (column * BLOCK_SIZE + positions)[None, :] < metadata.seq_lens[:, None]
        scores.masked_fill_(~visible[:, None, None, :], float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(-1, keepdim=True))
        shift = torch.where(new_max == float("-inf"), 0.0, new_max)
        weights = torch.exp(scores - shift)
        correction = torch.exp(running_max - shift)
        running_sum = running_sum * correction + weights.sum(-1, keepdim=True)
        acc = acc * correction + torch.matmul(weights, values)
        running_max = new_max
    return (acc / running_sum).view(num_reqs, HEADS, HEAD_DIM)


def per_request_loop(q, cache, metadata, scale):
    """The backend before, for prefill chunks: one causal SDPA call per request."""
    out = torch.empty_like(q)
    starts, seq_lens = metadata.query_start_loc_cpu.tolist(), metadata.seq_lens_cpu.tolist()
    for i, seq_len in enumerate(seq_lens):
        start, end = starts[i], starts[i + 1]
        pages = metadata.block_tables[i, : -(-seq_len // BLOCK_SIZE)]
        keys = cache[0][pages].flatten(0, 1)[:seq_len]
        values = cache[1][pages].flatten(0, 1)[:seq_len]
        query_pos = torch.arange(seq_len - (end - start), seq_len)
        mask = torch.arange(seq_len)[None, :] <= query_pos[:, None]
        out[start:end] = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True).transpose(0, 1)
    return out


def _time(options: dict, args_of, repeats: int, calls: int, flush=None) -> dict[str, dict[str, list[float]]]:
    """Seconds per call of each option, {"cpu": [...], "wall": [...]}, one entry per run. With
    `flush`, it runs (untimed) before every call."""
    seconds = {name: {"cpu": [], "wall": []} for name in options}
    for _ in range(repeats):
        for name, fn in options.items():
            cpu = wall = 0.0
            for _ in range(calls):
                if flush is not None:
                    flush()
                start_cpu, start_wall = time.process_time(), time.perf_counter()
                fn(*args_of)
                cpu, wall = cpu + time.process_time() - start_cpu, wall + time.perf_counter() - start_wall
            seconds[name]["cpu"].append(cpu / calls)
            seconds[name]["wall"].append(wall / calls)
    return seconds


def _kernel_at(revision: str):
    """The C kernel as it was at a git revision, compiled beside the current one (the baseline of
    a kernel change, side by side in this process)."""
    source = file_at(revision, "kernels/cpu/paged_attention.c")
    folder = Path(tempfile.mkdtemp(prefix="kvpilot-kernel-"))
    (folder / "paged_attention.c").write_text(source)
    # Through the backend, as the kept kernel is timed: the same wrapper and (empty) cache write.
    return _backend_call(CpuPagedAttention(kernel=bind(load_source(folder / "paged_attention.c"))))


def _min_median(runs: list[float]) -> tuple[float, float]:
    return min(runs), statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-reqs", type=int, default=48, help="decoding requests")
    parser.add_argument("--num-prefills", type=int, default=8, help="prefill chunks of 64 tokens")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--baseline", metavar="REV", help="also time the C kernel of this git revision")
    parser.add_argument("--cold", action="store_true",
                        help="read 64 MiB before every call, untimed: the cache comes from memory, as in an engine "
                             "step (the weights and the other layers pass through the CPU caches in between)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    scale = HEAD_DIM**-0.5
    workloads = {
        f"decode, {args.num_reqs} requests, contexts 96..320": (
            _step(rng, args.num_reqs, (95, 319), 1),
            {"torch backend (index_select pages + grouped-query SDPA)": torch_backend,
             "advanced index + SDPA (GQA repeat)": advanced_index_sdpa_gqa,
             "index_select + SDPA (GQA repeat)": index_select_sdpa_gqa,
             "index_select + matmul/softmax/matmul": index_select_matmul,
             "block-wise online softmax": blockwise_online_softmax}),
        f"prefill, {args.num_prefills} chunks of 64 after 0..192 cached": (
            _step(rng, args.num_prefills, (0, 192), 64),
            {"torch backend (index_select pages + grouped-query SDPA)": torch_backend,
             "one SDPA call per request": per_request_loop}),
    }
    if args.baseline:
        baseline = _kernel_at(args.baseline)
        for _, options in workloads.values():
            options[f"C kernel at {args.baseline}"] = baseline
    flush = None
    if args.cold:
        scratch = torch.ones(16 << 20)
        flush = scratch.sum
    print(f"torch threads: {torch.get_num_threads()}; ms per layer call, min / median of {args.repeats} runs "
          f"of {args.calls} calls; CPU caches {'flushed before each call' if args.cold else 'warm'}")
    print()
    print("| workload | kept: cpu backend (C kernel), CPU ms | option, CPU ms | option / kept, CPU time | "
          "same, wall clock |")
    print("|---|---|---|---|---|")
    memory = []
    for workload, ((q, cache, metadata), options) in workloads.items():
        expected = kept(q, cache, metadata, scale)
        for fn in options.values():
            torch.testing.assert_close(fn(q, cache, metadata, scale), expected, rtol=1e-4, atol=1e-4)
        seconds = _time({"kept": kept, **options}, (q, cache, metadata, scale), args.repeats, args.calls, flush)
        ours = {clock: _min_median(runs) for clock, runs in seconds["kept"].items()}
        kv_bytes = int(metadata.seq_lens.sum()) * 2 * KV_HEADS * HEAD_DIM * cache.element_size()
        memory.append(f"- {workload}: {kv_bytes / 1e6:.1f} MB of K/V per call, read by the kept kernel at "
                      f"{kv_bytes / ours['wall'][0] / 1e9:.1f} GB/s (its fastest call, wall clock)")
        for name in options:
            theirs = {clock: _min_median(runs) for clock, runs in seconds[name].items()}
            ratios = {clock: (theirs[clock][0] / ours[clock][0], theirs[clock][1] / ours[clock][1])
                      for clock in ours}
            print(f"| {workload} | {ours['cpu'][0] * 1e3:.3f} / {ours['cpu'][1] * 1e3:.3f} | {name}: "
                  f"{theirs['cpu'][0] * 1e3:.3f} / {theirs['cpu'][1] * 1e3:.3f} | "
                  f"{ratios['cpu'][0]:.2f}x / {ratios['cpu'][1]:.2f}x | "
                  f"{ratios['wall'][0]:.2f}x / {ratios['wall'][1]:.2f}x |", flush=True)
    print()
    print(*memory, f"- for scale, one thread summing a 256 MiB tensor: {_streaming_read_gbps():.1f} GB/s", sep="\n")


def _streaming_read_gbps() -> float:
    """This machine's memory bandwidth as one thread streams it (the best of five sums)."""
    scratch = torch.ones(64 << 20)
    scratch.sum()
    best = min(_timed_once(scratch.sum) for _ in range(5))
    return scratch.numel() * scratch.element_size() / best / 1e9


def _timed_once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
