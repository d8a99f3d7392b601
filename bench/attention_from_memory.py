"""A decode step's paged attention (the C kernel) on SmolLM2-135M's shapes: from L2, from memory, and
the read of the same bytes alone, side by side in one process.

Sixteen requests decode over contexts of 130..255 tokens (9 query heads over 3 KV heads, head_dim
64, blocks of 16), one call per layer for 30 layers, as an engine step makes them. Three places
for the cache:
- `L2`: every request reads the same 16 blocks, and every layer the same cache: the arithmetic alone;
- `memory, scattered`: a cache per layer, each request's blocks in random order (an engine's
  blocks after some traffic);
- `memory, consecutive`: a cache per layer, each request's blocks one after the other.
Beside them, `torch.sum` over every layer's cache: what streaming the same bytes costs. Runs are
interleaved; medians of `--repeats` steps in wall-clock time, threads as torch has them.
`--kernel FILE` also times a variant of kernels/cpu/paged_attention.c beside the kept one
(checked against it first).

    .venv/bin/python bench/attention_from_memory.py [--threads 2] [--kernel FILE] [--tiny]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kvpilot.kernels.cpu.build import load_source
from kvpilot.kernels.cpu.paged_attention import bind, paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def _block_tables(seq_lens: torch.Tensor, order: str, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Each request's blocks, in random or consecutive order over one cache; and the cache's blocks."""
    counts = (-(-seq_lens // BLOCK_SIZE)).tolist()
    total = sum(counts) + 1  # block 0: the null block, never read
    pages = (torch.randperm(total - 1, generator=gen) if order == "scattered" else torch.arange(total - 1)) + 1
    tables = torch.zeros(len(counts), max(counts), dtype=torch.int64)
    start = 0
    for i, count in enumerate(counts):
        tables[i, :count] = pages[start : start + count]
        start += count
    return tables, total


def _caches(layers: int, blocks: int, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(layers)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-reqs", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--kernel", type=Path, help="a variant of paged_attention.c to time beside the kept one")
    parser.add_argument("--tiny", action="store_true", help="2 requests, 2 layers, 2 repeats: a smoke run")
    args = parser.parse_args()
    if args.tiny:
        args.num_reqs, args.layers, args.repeats = 2, 2, 2
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(130, 256, (args.num_reqs,), generator=gen, dtype=torch.int64)
    query_start_loc = torch.arange(args.num_reqs + 1, dtype=torch.int64)
    q = torch.randn(args.num_reqs, HEADS, HEAD_DIM, generator=gen)
    scale = HEAD_DIM ** -0.5

    # (block tables, a cache per layer): in the L2 case every request reads the same blocks, one
    # request's worth, and every layer the same cache.
    hot_blocks = -(-int(seq_lens.max()) // BLOCK_SIZE)
    hot = (torch.arange(1, hot_blocks + 1).repeat(args.num_reqs, 1), _caches(1, hot_blocks + 1, gen) * args.layers)
    places = {"L2": hot}
    for order in ("scattered", "consecutive"):
        tables, blocks = _block_tables(seq_lens, order, gen)
        places[f"memory, {order}"] = (tables, _caches(args.layers, blocks, gen))

    kernels = {"kept": None}
    if args.kernel:
        kernels[args.kernel.name] = bind(load_source(args.kernel))
        tables, caches = places["memory, scattered"]
        kept = paged_attention(q, *caches[0], tables, query_start_loc, seq_lens, scale)
        other = paged_attention(q, *caches[0], tables, query_start_loc, seq_lens, scale, kernel=kernels[args.kernel.name])
        difference = (other - kept).abs().max().item()
        if difference > 1e-4:
            raise SystemExit(f"{args.kernel} is not the kept kernel's attention: max abs diff {difference:.2e}")
        print(f"{args.kernel.name} against the kept kernel: max abs diff {difference:.2e}")

    out = torch.empty_like(q)

    def step(kernel, tables, caches) -> None:
        for key_cache, value_cache in caches:
            paged_attention(q, key_cache, value_cache, tables, query_start_loc, seq_lens, scale, out=out, kernel=kernel)

    def stream(caches) -> None:
        for key_cache, value_cache in caches:
            key_cache.sum()
            value_cache.sum()

    runs = {(kernel, place): [] for kernel in kernels for place in places}
    runs["torch.sum of the caches", "memory, scattered"] = []
    for _ in range(args.repeats):
        for (kernel, place), times in runs.items():
            tables, caches = places[place]
            start = time.perf_counter()
            if kernel in kernels:
                step(kernels[kernel], tables, caches)
            else:
                stream(caches)
            times.append(time.perf_counter() - start)

    read = args.layers * int(seq_lens.sum()) * KV_HEADS * HEAD_DIM * 4 * 2
    held = sum(key_cache.numel() * 4 * 2 for key_cache, _ in places["memory, scattered"][1])
    print(f"{args.num_reqs} decodes of {int(seq_lens.min())}..{int(seq_lens.max())} keys, {args.layers} layers, "
          f"{args.threads} threads: {read / 1e6:.0f} MB of keys and values read a step, {held / 1e6:.0f} MB held\n")
    baseline = statistics.median(runs["kept", "L2"])
    print("| workload | ms a step (median) | GB/s | x the kept kernel from L2 |")
    print("|---|---|---|---|")
    for (kernel, place), times in runs.items():
        seconds = statistics.median(times)
        name = f"{kernel} kernel, {place}" if kernel in kernels else kernel
        moved = read if kernel in kernels else held
        print(f"| {name} | {seconds * 1e3:.2f} | {moved / seconds / 1e9:.1f} | {seconds / baseline:.2f}x |")


if __name__ == "__main__":
    main()
