"""The `kvpilot bench` subcommands: serve, sweep, plot. Stdlib only until a handler runs."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from kvpilot.runtime.argtypes import DefaultsHelpFormatter, positive_int


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number or inf, got {text}")
    return value


def _list_of(parse: Callable[[str], object]) -> Callable[[str], list]:
    def parse_list(text: str) -> list:
        return [parse(item) for item in text.split(",")]

    parse_list.__name__ = "comma-separated list"
    return parse_list


def add_bench(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmark an OpenAI-compatible server (vllm bench's habits)",
                                description="Benchmark any OpenAI-compatible server: kvpilot, vLLM, or another.")
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="KIND")
    serve = kinds.add_parser("serve", help="stream requests at a server and report throughput and latency",
                             formatter_class=DefaultsHelpFormatter)
    _add_bench_load_arguments(serve)
    serve.add_argument("--request-rate", metavar="RPS", type=_rate, default=float("inf"),
                       help="Poisson arrivals at this many requests/s; inf: all at once")
    serve.add_argument("--max-concurrency", metavar="N", type=positive_int, help="most requests in flight")
    serve.set_defaults(handler=_bench_serve, subparser=serve)

    sweep = kinds.add_parser("sweep", help="run `bench serve` over request rates or concurrencies into one JSON",
                             formatter_class=DefaultsHelpFormatter)
    _add_bench_load_arguments(sweep)
    swept = sweep.add_mutually_exclusive_group(required=True)
    swept.add_argument("--request-rates", metavar="R1,R2,...", type=_list_of(_rate), help="e.g. 1,2,4,inf")
    swept.add_argument("--concurrencies", metavar="N1,N2,...", type=_list_of(positive_int), help="e.g. 1,4,16")
    sweep.set_defaults(handler=_bench_sweep, subparser=sweep)

    plot = kinds.add_parser("plot", help="turn result JSONs into PNG figures (one line per file)")
    plot.add_argument("results", metavar="RESULT_JSON", nargs="+", type=Path)
    plot.add_argument("--output-dir", metavar="DIR", type=Path, default=Path("."), help="where the PNGs go")
    plot.set_defaults(handler=_bench_plot, subparser=plot)


def _add_bench_load_arguments(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    sub.add_argument("--model", required=True, help="the model name the server serves")
    sub.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    sub.add_argument("--dataset", default="random", metavar="random|shared-prefix|FILE.jsonl",
                     help='prompts: random words, a shared prefix plus random words, or a JSONL file of '
                          '{"prompt": ..., "output_len": ...}')
    sub.add_argument("--num-prompts", metavar="N", type=positive_int, default=100)
    sub.add_argument("--input-len", metavar="N", type=positive_int, default=128,
                     help="words per prompt (after the shared prefix)")
    sub.add_argument("--output-len", metavar="N", type=positive_int, default=128, help="max tokens per request")
    sub.add_argument("--prefix-len", metavar="N", type=positive_int, default=256,
                     help="words of the shared prefix (shared-prefix dataset)")
    sub.add_argument("--ignore-eos", action="store_true", help="generate --output-len tokens even past EOS (vLLM's field)")
    sub.add_argument("--num-warmups", metavar="N", type=int, default=1, help="untimed requests first")
    sub.add_argument("--seed", type=int, default=0)
    # Read from the environment when used, not as the default: --help shows defaults.
    sub.add_argument("--api-key", metavar="KEY", help="Bearer key (default: $OPENAI_API_KEY)")
    sub.add_argument("--result-json", metavar="PATH", type=Path, help="write the full result here")
    sub.add_argument("--label", help="the name of this run in `bench plot` (default: the file name)")


def _bench_requests(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """The dataset description for the result JSON, and a builder of its prompts from a seed."""
    from kvpilot.runtime.benchmarks import datasets

    if args.dataset == "random":
        make = functools.partial(datasets.random_dataset, args.num_prompts, args.input_len, args.output_len)
    elif args.dataset == "shared-prefix":
        make = functools.partial(datasets.shared_prefix_dataset, args.num_prompts, args.prefix_len,
                                 args.input_len, args.output_len)
    else:
        path = Path(args.dataset)
        if not path.is_file():
            parser.error(f"argument --dataset: not random, shared-prefix or a file: {args.dataset}")
        try:
            requests = datasets.file_dataset(path, args.num_prompts, args.output_len)
        except ValueError as err:
            parser.error(f"argument --dataset: {err}")

        def make(seed: int) -> list:
            return requests  # a file's prompts are what they are, whatever the seed
    described = {"dataset": args.dataset, "input_len": args.input_len, "output_len": args.output_len,
                 "prefix_len": args.prefix_len if args.dataset == "shared-prefix" else None}
    return described, make


def _bench_config(args: argparse.Namespace, **load):
    from kvpilot.runtime.benchmarks.serve import ServeBenchConfig

    return ServeBenchConfig(base_url=args.base_url, model=args.model, endpoint=args.endpoint,
                            api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
                            ignore_eos=args.ignore_eos, num_warmups=args.num_warmups, seed=args.seed, **load)


def _write_result(args: argparse.Namespace, result: dict) -> None:
    if args.label:
        result["label"] = args.label
    if args.result_json is not None:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(result, indent=1) + "\n")


def _bench_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from kvpilot.runtime.benchmarks.results import format_summary
    from kvpilot.runtime.benchmarks.serve import BenchError, benchmark_result

    described, make = _bench_requests(args, parser)
    config = _bench_config(args, request_rate=args.request_rate, max_concurrency=args.max_concurrency)
    try:
        result = benchmark_result(config, make(args.seed), described)
    except BenchError as err:
        print(f"kvpilot bench serve: error: {err}", file=sys.stderr)
        return 1
    print(format_summary(result))
    _write_result(args, result)
    return 0


def _bench_sweep(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from kvpilot.runtime.benchmarks.results import format_summary
    from kvpilot.runtime.benchmarks.serve import BenchError, sweep_results

    described, make = _bench_requests(args, parser)
    try:
        result = sweep_results(_bench_config(args), make, described, request_rates=args.request_rates or (),
                               concurrencies=args.concurrencies or ())
    except BenchError as err:
        print(f"kvpilot bench sweep: error: {err}", file=sys.stderr)
        return 1
    for run in result["runs"]:
        print(format_summary(run, f"{result['sweep']} = {run[result['sweep']]}"))
    _write_result(args, result)
    return 0


def _bench_plot(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from kvpilot.runtime.benchmarks.plot import plot_results

    for path in args.results:
        if not path.is_file():
            parser.error(f"argument RESULT_JSON: no such file: {path}")
    try:
        written = plot_results(args.results, args.output_dir)
    except (ValueError, KeyError) as err:
        parser.error(f"argument RESULT_JSON: not a bench serve or sweep result: {err}")
    for path in written:
        print(path)
    return 0
