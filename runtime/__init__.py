"""kvpilot's engine runtime: `from kvpilot.runtime import LLM, SamplingParams`."""

from kvpilot.runtime.request import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; resolved lazily so that the scheduler, the KV-cache
    # manager and their tests import without them.
    if name == "LLM":
        from kvpilot.runtime.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvpilot.runtime' has no attribute {name!r}")
