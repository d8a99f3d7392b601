"""Which attention backend an engine gets, and the errors a wrong choice gives."""

from __future__ import annotations

import pytest

from kvpilot.runtime.config import EngineArgs
from kvpilot.runtime.layers.attention import resolve_attention_backend


def test_auto_is_triton_on_cuda_and_torch_on_cpu():
    assert resolve_attention_backend("auto", "cuda") == "triton"
    assert resolve_attention_backend("auto", "cpu") == "torch"


def test_explicit_choices_are_kept():
    assert resolve_attention_backend("torch", "cuda") == "torch"
    assert resolve_attention_backend("triton", "cuda") == "triton"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_attention_backend("triton", "cpu") == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_attention_backend("triton", "cpu")


def test_unknown_backend_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        resolve_attention_backend("flash", "cuda")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineArgs(model=str(tiny_llama_dir), attention_backend="flash").create_engine_config()
