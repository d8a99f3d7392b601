"""argparse value types and the help formatter shared by the `kvpilot` subcommands: a bad value is
a usage error."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative number, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return value


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default, except absent ones (None, False), which the help text explains itself
    (or needs not: "default: None" after "default: $OPENAI_API_KEY" says nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)
