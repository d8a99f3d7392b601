"""The serving sweep on a real model: `kvpilot bench sweep` over concurrencies against `kvpilot serve`
on SmolLM2-135M-Instruct (the embedded default), then `kvpilot bench plot`.

The two commands run exactly as a user would type them (printed in the report), against a server
this script starts: random-word prompts, EOS ignored, one warm-up request of its own words first,
and every concurrency with prompts of its own (the sweep's seed + i), so no point reuses another's
prefix-cache blocks.

    .venv/bin/python bench/serving_sweep.py [--model FILE.gguf|DIR] [--output-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from kvpilot.runtime.argtypes import positive_int
from kvpilot.runtime.benchmarks.local_server import local_server
from kvpilot.runtime.benchmarks.report import BenchReport, markdown_table
from kvpilot.runtime.models.default_model import ensure_default_model

ROOT = Path(__file__).resolve().parents[1]


def _kvpilot(*args: str) -> str:
    """Runs `kvpilot ARGS` (this interpreter's) from the repository root, fails loudly; returns the
    command as typed there."""
    subprocess.run([sys.executable, "-m", "kvpilot.runtime.cli", *args], check=True, cwd=ROOT)
    return shlex.join(["kvpilot", *args])


def _path(path: Path) -> str:
    """`path` as the commands show it: relative to the repository root when it lies inside."""
    resolved = path.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(resolved)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a .gguf file or Hugging Face folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--concurrencies", default="1,4,16")
    parser.add_argument("--num-prompts", type=positive_int, default=16)
    parser.add_argument("--input-len", type=positive_int, default=64)
    parser.add_argument("--output-len", type=positive_int, default=32)
    parser.add_argument("--threads", type=positive_int, default=2, help="torch threads of the server")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "bench/results/serving_sweep")
    args = parser.parse_args()
    report = BenchReport(__file__, args.output_dir, args.threads, ROOT)
    model = args.model or str(ensure_default_model())
    name = "smollm2" if not args.model else "bench"
    result_json = report.output_path("sweep.json")

    with local_server(model, "--served-model-name", name, env={"OMP_NUM_THREADS": str(args.threads)}) as base_url:
        sweep = _kvpilot("bench", "sweep", "--base-url", base_url, "--model", name, "--concurrencies", args.concurrencies,
                         "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                         "--output-len", str(args.output_len), "--ignore-eos", "--label", f"kvpilot {name}",
                         "--result-json", _path(result_json))
    plot = _kvpilot("bench", "plot", _path(result_json), "--output-dir", _path(args.output_dir))

    runs = json.loads(result_json.read_text())["runs"]
    rows = [[run["max_concurrency"], f"{run['request_throughput']:.3g}", f"{run['output_throughput']:.3g}",
             f"{run['median_ttft_ms']:.0f} / {run['p99_ttft_ms']:.0f}", f"{run['median_itl_ms']:.0f} / {run['p99_itl_ms']:.0f}",
             f"{run['median_tpot_ms']:.0f}", f"{run['median_e2el_ms']:.0f}"] for run in runs]
    table = markdown_table(["max concurrency", "req/s", "output tok/s", "TTFT median / p99 ms", "ITL median / p99 ms",
                            "TPOT median ms", "E2EL median ms"], rows)
    body = (f"Model: {'SmolLM2-135M-Instruct (GGUF, the embedded default), float32' if not args.model else model}; "
            f"`kvpilot serve` with its defaults and {args.threads} torch threads. Each point: {args.num_prompts} "
            f"streaming completions of {args.input_len} random words, {args.output_len} tokens out (EOS ignored). "
            f"The commands, with the server's URL:\n\n```sh\n{sweep.replace(base_url, '$URL')}\n"
            f"{plot}\n```\n\n{table}")
    first, last = runs[0], runs[-1]
    headline = (f"serving {name} at concurrency {last['max_concurrency']}: {last['output_throughput']:.3g} output tok/s, "
                f"{last['output_throughput'] / first['output_throughput']:.1f}x concurrency {first['max_concurrency']}")
    figures = [args.output_dir / "throughput.png", args.output_dir / "latency.png"]
    report.write(body, figures, {"runs": [{k: v for k, v in run.items() if not isinstance(v, list)} for run in runs]},
                 headline)


if __name__ == "__main__":
    main()
