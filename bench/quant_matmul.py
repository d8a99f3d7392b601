"""The quantized CPU matmul (kernels/cpu/quant_matmul.c) on SmolLM2-135M's real shapes, against
float32 `F.linear` on the same weights dequantized, side by side in one process.

Each shape has as many distinct weights as the model has layers, and a timed pass runs through
all of them once: no weight sits in a core's own caches between its uses, though a large shared
L3 may hold a shape's weights between passes. The decode step's rows run every weight of a step
in its order (all layers, then the LM head, Q8_0 as the GGUF file stores the tied embedding),
more bytes than any cache: what a real decode step reads. Rows at one row of x (a decode step of
one stream) and at sixteen. The achieved weight-read bandwidth is set against the machine's read
bandwidth measured in the same run (a `torch.sum` over 1 GiB); above 100 % means the shared L3
held part of the weights.

    .venv/bin/python bench/quant_matmul.py [--qtype Q4_1] [--isa avx2] [--output-dir DIR]

`--tiny` runs every row on tiny shapes (the smoke test in tests/bench); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvpilot.kernels.cpu import quant_matmul as qm
from kvpilot.kernels.cpu.isa import ISA_ENV
from kvpilot.kernels.cpu.quant_formats import random_blocks
from kvpilot.runtime.benchmarks.plot import line_figure
from kvpilot.runtime.benchmarks.report import BenchReport, markdown_table

ROOT = Path(__file__).resolve().parents[1]
LAYERS, HEAD_QTYPE = 30, "Q8_0"
# (name, rows, cols, per layer): q and o, k and v, gate and up, down; then the LM head once.
LAYER_SHAPES = [("q_proj, o_proj", 576, 576, 2), ("k_proj, v_proj", 192, 576, 2),
                ("gate_proj, up_proj", 1536, 576, 2), ("down_proj", 576, 1536, 1)]
HEAD = ("lm_head", 49152, 576, 1)
TINY_LAYER_SHAPES = [("q_proj, o_proj", 64, 64, 2), ("down_proj", 32, 256, 1)]
TINY_HEAD = ("lm_head", 512, 64, 1)
BANDWIDTH_BYTES = 1 << 30


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm: first-touch pages, thread pool up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def read_bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes per second of a large reduction: what streaming weights from memory can reach."""
    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    return num_bytes / median_seconds(lambda: data.sum(), repeats)


def weights(qtype: str, rows: int, cols: int, copies: int, seed: int) -> list[qm.PackedWeight]:
    gen = torch.Generator().manual_seed(seed)
    if qtype == "int8":
        return [qm.pack_int8(torch.randn(rows, cols, generator=gen)) for _ in range(copies)]
    return [qm.PackedWeight(qtype, rows, cols, random_blocks(qtype, rows, cols, gen)) for _ in range(copies)]


def measure(packed: list[qm.PackedWeight], dense: list[torch.Tensor], x: torch.Tensor, repeats: int) -> dict:
    """One pass over the weights in order, for both sides; seconds per pass."""
    diff = max((qm.quant_matmul(x[w.cols], w) - F.linear(x[w.cols], d)).abs().max().item()
               for w, d in zip(packed, dense))
    kernel = median_seconds(lambda: [qm.quant_matmul(x[w.cols], w) for w in packed], repeats)
    torch_mm = median_seconds(lambda: [F.linear(x[d.shape[1]], d) for d in dense], repeats)
    return {"kernel_s": kernel, "torch_s": torch_mm, "bytes": sum(w.nbytes for w in packed),
            "max_abs_diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qtype", default="Q4_1", choices=sorted(qm.PACKED_TYPES),
                        help="the layers' type (SmolLM2's default file is Q4_1); the head stays Q8_0")
    parser.add_argument("--isa", help=f"force an ISA level (as ${ISA_ENV} does); default: the best that runs")
    parser.add_argument("--num-tokens", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, 2 layers: a smoke run")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "bench/results/quant_matmul")
    args = parser.parse_args()
    if args.isa:
        os.environ[ISA_ENV] = args.isa
    torch.set_num_threads(args.threads)
    layer_shapes, head, layers = (TINY_LAYER_SHAPES, TINY_HEAD, 2) if args.tiny else (LAYER_SHAPES, HEAD, LAYERS)
    repeats = 1 if args.tiny else args.repeats
    report = BenchReport(__file__, args.output_dir, args.threads, ROOT)
    level = qm.chosen_isa()
    bandwidth = read_bandwidth(BANDWIDTH_BYTES >> (8 if args.tiny else 0), repeats)

    shapes = [(shape, args.qtype, layers) for shape in layer_shapes] + [(head, HEAD_QTYPE, 1)]
    packed = {shape: weights(qtype, shape[1], shape[2], copies, seed=shape[1] * shape[2])
              for shape, qtype, copies in shapes}
    dense = {shape: [qm.dequantize(w) for w in ws] for shape, ws in packed.items()}
    # A decode step's order: layer by layer, each weight as often as the layer uses its shape.
    step_order = [(shape, layer) for layer in range(layers) for shape, _, _ in shapes[:-1]
                  for _ in range(shape[3])] + [(head, 0)]
    rows, step = [], {}
    for num_tokens in args.num_tokens:
        gen = torch.Generator().manual_seed(1)
        x = {cols: torch.randn(num_tokens, cols, generator=gen) for cols in {shape[2] for shape in packed}}
        # Shape by shape for the first count of tokens only: the step's row says the rest.
        for shape, qtype, copies in shapes if num_tokens == args.num_tokens[0] else ():
            result = measure(packed[shape], dense[shape], x, repeats)
            per_matmul = {**result, "kernel_s": result["kernel_s"] / copies, "torch_s": result["torch_s"] / copies,
                          "bytes": result["bytes"] / copies}
            rows.append(_row(f"{shape[0]} {shape[1]}x{shape[2]} {qtype}", num_tokens, per_matmul, bandwidth))
        step[num_tokens] = measure([packed[shape][layer] for shape, layer in step_order],
                                   [dense[shape][layer] for shape, layer in step_order], x, repeats)
        rows.append(_row(f"**decode step, all {layers} layers + head, in order**", num_tokens, step[num_tokens],
                         bandwidth))
    body = "\n\n".join([
        f"Kernel ISA level: **{level}** (runnable here: {', '.join(qm.runnable_isas())}). Measured read "
        f"bandwidth (torch.sum over {BANDWIDTH_BYTES >> (8 if args.tiny else 0) >> 20} MiB float32): "
        f"**{bandwidth / 1e9:.1f} GB/s**. Times are medians of {repeats} passes. A shape's row: per matmul, "
        f"each pass reading its {layers} distinct weights, which a large L3 may hold between passes; the "
        f"decode step's row: one pass over every weight in a step's order, larger than any cache. `x` is the kernel's speedup over float32 `F.linear` on the "
        f"dequantized weights; `of bw` is the kernel's weight bytes per second over the measured read bandwidth.",
        markdown_table(["workload", "tokens", "kernel µs", "float32 mm µs", "speedup", "weight MB", "kernel GB/s",
                        "of bw", "max abs diff"], rows),
    ])
    one = step[args.num_tokens[0]]
    headline = (f"{args.qtype} decode step at {args.num_tokens[0]} token(s): {one['kernel_s'] * 1e3:.2f} ms of "
                f"matmuls against {one['torch_s'] * 1e3:.2f} ms in float32 "
                f"({one['torch_s'] / one['kernel_s']:.2f}x), {one['bytes'] / one['kernel_s'] / bandwidth:.0%} of "
                f"the measured read bandwidth")
    figure = line_figure(
        report.output_path("decode_step_matmuls.png"),
        {f"{args.qtype} kernel ({level})": [(n, v["kernel_s"] * 1e3) for n, v in step.items()],
         "float32 F.linear, dequantized": [(n, v["torch_s"] * 1e3) for n, v in step.items()]},
        xlabel="rows of x (tokens in the step)", ylabel="ms of matmuls per step", log_x=True,
        title=f"SmolLM2-135M decode step's matmuls, {args.threads} thread(s)")
    report.write(body, [figure], {"isa": level, "read_bandwidth_bytes_per_s": bandwidth, "rows": rows,
                            "steps": {str(k): v for k, v in step.items()}}, headline)


def _row(name: str, num_tokens: int, result: dict, bandwidth: float) -> list:
    kernel, torch_mm = result["kernel_s"], result["torch_s"]
    return [name, num_tokens, f"{kernel * 1e6:.1f}", f"{torch_mm * 1e6:.1f}", f"{torch_mm / kernel:.2f}x",
            f"{result['bytes'] / 1e6:.2f}", f"{result['bytes'] / kernel / 1e9:.1f}",
            f"{result['bytes'] / kernel / bandwidth:.0%}", f"{result['max_abs_diff']:.1e}"]


if __name__ == "__main__":
    main()
