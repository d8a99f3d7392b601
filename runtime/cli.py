"""The `kvpilot` command: one `_add_<subcommand>` function and one handler per subcommand."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

# A handler gets the parsed args and its own subparser, so usage errors it finds late
# (after parsing) still exit 2 with that subcommand's usage line.
Handler = Callable[[argparse.Namespace, argparse.ArgumentParser], int]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpilot", description="An LLM engine in the shape of vLLM V1.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_make_tiny_model(commands)
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    return handler(args, args.subparser)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


# make_tiny_model argument -> the flag that sets it, to name the flag in usage errors.
_TINY_MODEL_FLAGS = {
    "arch": "--arch",
    "num_layers": "--layers",
    "hidden_size": "--hidden",
    "num_heads": "--heads",
    "num_kv_heads": "--kv-heads",
    "vocab_size": "--vocab",
    "llama3_rope_scaling": "--llama3-rope-scaling",
}


def _add_make_tiny_model(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser(
        "make-tiny-model",
        help="write a tiny random-weight Hugging Face checkpoint for tests and demos",
        description="Write a tiny checkpoint (fixed-seed random weights, locally trained BPE tokenizer).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sub.add_argument("out_dir", metavar="DIR", help="output folder (created if missing)")
    # Spelled out rather than imported: tiny_model pulls in torch, which `operator` must not need.
    sub.add_argument("--arch", choices=("llama", "qwen2"), default="llama", help="model family")
    sub.add_argument("--seed", metavar="N", type=int, default=0, help="weight seed")
    sizes = [
        ("--layers", "num_layers", 2, "decoder layers"),
        ("--hidden", "hidden_size", 64, "hidden size"),
        ("--heads", "num_heads", 4, "attention heads"),
        ("--kv-heads", "num_kv_heads", 2, "key/value heads (GQA)"),
        ("--vocab", "vocab_size", 512, "vocabulary size, tokenizer and model alike"),
    ]
    for flag, dest, default, help_text in sizes:
        sub.add_argument(flag, dest=dest, metavar="N", type=_positive_int, default=default, help=help_text)
    sub.add_argument(
        "--llama3-rope-scaling", action="store_true", help="use llama3 rope scaling (llama only)"
    )
    sub.set_defaults(handler=_make_tiny_model, subparser=sub)


def _make_tiny_model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    # Imported per call: torch and transformers load only for the subcommands that need them.
    from kvpilot.runtime.tiny_model import TinyModelError, make_tiny_model

    try:
        out = make_tiny_model(
            args.out_dir,
            arch=args.arch,
            seed=args.seed,
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            vocab_size=args.vocab_size,
            llama3_rope_scaling=args.llama3_rope_scaling,
        )
    except TinyModelError as err:
        parser.error(f"argument {_TINY_MODEL_FLAGS[err.param]}: {err}")
    print(out)
    return 0
