"""Triton kernels on a CUDA device: each against its torch reference, attention also against
`scaled_dot_product_attention` on equivalent contiguous inputs, and every kernel's achieved
memory bandwidth as a fraction of the device's peak, measured in the same run by a large
device-to-device copy.

    .venv/bin/python bench/kernels.py [--dtype bfloat16]

On a machine without CUDA it says so and exits 0: the interpreter proves the kernels correct on
a CPU (tests/kernels), but it says nothing about their speed. `--tiny` runs every row on tiny
shapes instead (under the Triton interpreter where there is no GPU), so that the script cannot
rot between GPU runs; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
HIDDEN, NUM_TOKENS = 4096, 8192
COPY_BYTES = 2 * 1024**3


@dataclass
class Row:
    name: str
    seconds: float
    bytes_moved: int
    baselines: dict[str, float]
    max_abs_diff: float


def timed(fn) -> float:
    """Median seconds per call: on CUDA from events (triton's do_bench: warm-up, cache flush,
    repeats); elsewhere (the tiny mode) from the host clock."""
    if not torch.cuda.is_available():
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3


def copy_bandwidth(device: torch.device) -> float:
    src = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / timed(lambda: dst.copy_(src))


def paged_inputs(batch: list[tuple[int, int]], dtype: torch.dtype, device: torch.device):
    """(query tokens, context tokens) per request; pages shuffled over the pool."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    pages = [-(-seq // BLOCK_SIZE) for _, seq in batch]
    num_blocks = sum(pages) + 1
    pool = torch.randperm(num_blocks - 1, generator=gen) + 1
    block_tables = torch.zeros(len(batch), max(pages), dtype=torch.int32)
    start = 0
    for i, n in enumerate(pages):
        block_tables[i, :n] = pool[start:start + n]
        start += n
    q_lens = torch.tensor([q for q, _ in batch])
    query_start_loc = torch.cat((torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0))).to(torch.int32)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    return dict(
        q=torch.randn(int(q_lens.sum()), NUM_HEADS, HEAD_DIM, dtype=dtype, device=device),
        key_cache=cache[0], value_cache=cache[1],
        block_tables=block_tables.to(device), query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor([s for _, s in batch], dtype=torch.int32, device=device),
        scale=HEAD_DIM**-0.5,
    )


def contiguous_sdpa(inputs, batch):
    """The same attention with each request's context gathered into dense [B, kv_heads, S, D] tensors
    beforehand (outside the timing): what attention costs without pages."""
    q, kc, vc = inputs["q"], inputs["key_cache"], inputs["value_cache"]
    tables, starts = inputs["block_tables"].long(), inputs["query_start_loc"].tolist()
    calls = []
    for i, (q_len, seq) in enumerate(batch):
        pages = tables[i, : -(-seq // BLOCK_SIZE)]
        k = kc[pages].flatten(0, 1)[:seq].transpose(0, 1).unsqueeze(0).contiguous()
        v = vc[pages].flatten(0, 1)[:seq].transpose(0, 1).unsqueeze(0).contiguous()
        qi = q[starts[i]:starts[i + 1]].transpose(0, 1).unsqueeze(0).contiguous()
        mask = None
        if q_len > 1:
            mask = torch.arange(seq, device=q.device)[None, :] <= torch.arange(seq - q_len, seq, device=q.device)[:, None]
        calls.append((qi, k, v, mask))
    if all(q_len == 1 for q_len, _ in batch) and len({s for _, s in batch}) == 1:
        # Equal decode contexts batch into one dense call.
        qs, ks, vs = (torch.cat([c[j] for c in calls]) for j in range(3))
        return lambda: F.scaled_dot_product_attention(qs, ks, vs, scale=inputs["scale"], enable_gqa=True)
    return lambda: [F.scaled_dot_product_attention(qi, k, v, attn_mask=m, scale=inputs["scale"], enable_gqa=True)
                    for qi, k, v, m in calls]


def attention_row(name, batch, dtype, device) -> Row:
    from kvpilot.kernels.paged_attention import paged_attention, paged_attention_reference

    inputs = paged_inputs(batch, dtype, device)
    sizes = dict(max_query_len=max(q for q, _ in batch), max_seq_len=max(s for _, s in batch))
    out = paged_attention(**inputs, **sizes)
    diff = (out.float() - paged_attention_reference(**inputs).float()).abs().max().item()
    element = inputs["q"].element_size()
    kv_bytes = sum(s for _, s in batch) * 2 * NUM_KV_HEADS * HEAD_DIM * element
    return Row(
        name, timed(lambda: paged_attention(**inputs, **sizes, out=out)), kv_bytes + 2 * inputs["q"].nbytes,
        {"torch reference": timed(lambda: paged_attention_reference(**inputs)),
         "SDPA, contiguous": timed(contiguous_sdpa(inputs, batch))},
        diff,
    )


def cache_write_row(dtype, device) -> Row:
    from kvpilot.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_reference

    num_tokens, num_blocks = NUM_TOKENS, max(1, NUM_TOKENS // BLOCK_SIZE)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    value = torch.randn_like(key)
    cache = torch.zeros(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:num_tokens]
    expected = cache.clone()
    reshape_and_cache(key, value, cache[0], cache[1], slots)
    reshape_and_cache_reference(key, value, expected[0], expected[1], slots)
    return Row(
        f"reshape_and_cache, {num_tokens} tokens", timed(lambda: reshape_and_cache(key, value, cache[0], cache[1], slots)),
        4 * key.nbytes, {"torch reference": timed(lambda: reshape_and_cache_reference(key, value, cache[0], cache[1], slots))},
        (cache.float() - expected.float()).abs().max().item(),
    )


def rms_norm_row(dtype, device) -> Row:
    from kvpilot.kernels.rms_norm import rms_norm, rms_norm_reference

    x = torch.randn(NUM_TOKENS, HIDDEN, dtype=dtype, device=device)
    residual, weight = torch.randn_like(x), torch.randn(HIDDEN, dtype=dtype, device=device)
    r1, r2 = residual.clone(), residual.clone()
    diff = (rms_norm(x, weight, 1e-6, r1).float() - rms_norm_reference(x, weight, 1e-6, r2).float()).abs().max().item()
    return Row(
        f"RMSNorm + residual, {NUM_TOKENS} x {HIDDEN}", timed(lambda: rms_norm(x, weight, 1e-6, residual)), 4 * x.nbytes,
        {"torch reference": timed(lambda: rms_norm_reference(x, weight, 1e-6, residual))}, diff,
    )


def rotary_row(dtype, device) -> Row:
    from kvpilot.kernels.rotary import rotary_embedding, rotary_embedding_reference

    num_tokens = NUM_TOKENS
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    angles = torch.rand(num_tokens, HEAD_DIM // 2, device=device)
    cos, sin = angles.cos(), angles.sin()
    positions = torch.randperm(num_tokens, device=device)
    q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
    rotary_embedding(positions, q1, k1, cos, sin)
    rotary_embedding_reference(positions, q2, k2, cos, sin)
    diff = max((q1.float() - q2.float()).abs().max().item(), (k1.float() - k2.float()).abs().max().item())
    return Row(
        f"rotary (neox) q+k, {num_tokens} tokens", timed(lambda: rotary_embedding(positions, q, k, cos, sin)),
        2 * (q.nbytes + k.nbytes), {"torch reference": timed(lambda: rotary_embedding_reference(positions, q, k, cos, sin))},
        diff,
    )


def rows(dtype, device, tiny: bool) -> list[Row]:
    if tiny:
        return [
            attention_row("decode, 3 seqs x 40 ctx", [(1, 40)] * 3, dtype, device),
            attention_row("decode, 2 seqs x 600 ctx", [(1, 600)] * 2, dtype, device),
            attention_row("mixed: 2 chunks of 5 over 20 ctx + 1 decode x 9", [(5, 20)] * 2 + [(1, 9)], dtype, device),
            cache_write_row(dtype, device), rms_norm_row(dtype, device), rotary_row(dtype, device),
        ]
    return [
        attention_row("decode, 64 seqs x 2048 ctx", [(1, 2048)] * 64, dtype, device),
        attention_row("split-K decode, 4 seqs x 16384 ctx", [(1, 16384)] * 4, dtype, device),
        attention_row("mixed: 2 chunks of 512 over 1536 ctx + 32 decode x 1024", [(512, 2048)] * 2 + [(1, 1024)] * 32,
                      dtype, device),
        cache_write_row(dtype, device), rms_norm_row(dtype, device), rotary_row(dtype, device),
    ]


def main() -> int:
    global NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HIDDEN, NUM_TOKENS, COPY_BYTES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, to check that the script runs; numbers mean nothing")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print("bench/kernels.py needs a CUDA device; none is visible, so nothing was measured.")
        return 0
    if args.tiny:
        NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HIDDEN, NUM_TOKENS, COPY_BYTES = 4, 2, 16, 64, 32, 2**24
        if not cuda:
            # Before the kernels are imported: Triton reads it when it decorates them.
            os.environ["TRITON_INTERPRET"] = "1"
    dtype, device = getattr(torch, args.dtype), torch.device("cuda" if cuda else "cpu")
    peak = copy_bandwidth(device)
    measured = rows(dtype, device, args.tiny)
    where = torch.cuda.get_device_name(device) if cuda else "CPU, Triton interpreter (tiny mode: the numbers mean nothing)"
    print(f"{where}, {args.dtype}; device-to-device copy: {peak / 1e9:.0f} GB/s\n")
    print("| workload | kernel | bandwidth (of copy) | torch reference | speed-up | SDPA, contiguous | speed-up "
          "| max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    for row in measured:
        bandwidth = row.bytes_moved / row.seconds
        cells = []
        for name in ("torch reference", "SDPA, contiguous"):
            baseline = row.baselines.get(name)
            cells += ["", ""] if baseline is None else [f"{baseline * 1e6:.0f} us", f"{baseline / row.seconds:.2f}x"]
        print(f"| {row.name} | {row.seconds * 1e6:.1f} us | {bandwidth / 1e9:.0f} GB/s ({bandwidth / peak:.0%}) | "
              + " | ".join(cells) + f" | {row.max_abs_diff:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
