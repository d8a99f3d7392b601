"""Which attention backend an engine gets, and the errors a wrong choice gives."""

from __future__ import annotations

import logging

import pytest
import torch

from kvpilot.kernels.cpu import build
from kvpilot.kernels.cpu import paged_attention as cpu_kernel
from kvpilot.runtime.config import EngineArgs
from kvpilot.runtime.layers.attention import get_attention_backend, resolve_attention_backend


def test_auto_is_triton_on_cuda_the_c_kernel_on_cpu_and_torch_elsewhere():
    assert resolve_attention_backend("auto", "cuda") == "triton"
    assert resolve_attention_backend("auto", "cpu") == "cpu"
    assert get_attention_backend("auto", torch.device("cpu"), torch.float32).name == "cpu"
    # The C kernel reads host memory only: on any other device (meta in the device tests) auto is torch.
    assert resolve_attention_backend("auto", "meta") == "torch"


def test_explicit_choices_are_kept():
    assert resolve_attention_backend("torch", "cuda") == "torch"
    assert resolve_attention_backend("triton", "cuda") == "triton"
    assert resolve_attention_backend("cpu", "cpu") == "cpu"


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """A machine without a C compiler: an empty kernel cache and $CC naming nothing."""
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(build.CC_ENV, str(tmp_path / "no-such-cc"))
    build.load.cache_clear()
    cpu_kernel.entry_point.cache_clear()
    yield
    build.load.cache_clear()
    cpu_kernel.entry_point.cache_clear()


def test_auto_falls_back_to_torch_and_says_why(no_compiler, caplog):
    with caplog.at_level(logging.WARNING, logger="kvpilot.runtime.layers.attention"):
        assert resolve_attention_backend("auto", "cpu") == "torch"
    [record] = caplog.records
    assert "attention backend: torch" in record.getMessage() and "no C compiler" in record.getMessage()


def test_an_explicit_cpu_backend_that_cannot_build_is_an_error(no_compiler):
    with pytest.raises(ValueError, match="'cpu' is unavailable: no C compiler"):
        resolve_attention_backend("cpu", "cpu")


def test_the_cpu_backend_refuses_other_devices_and_dtypes(caplog):
    with pytest.raises(ValueError, match="runs on a CPU device only"):
        resolve_attention_backend("cpu", "cuda")
    with pytest.raises(ValueError, match="supports float32, bfloat16, the model runs torch.float16"):
        resolve_attention_backend("cpu", "cpu", torch.float16)
    assert resolve_attention_backend("auto", "cpu", torch.bfloat16) == "cpu"
    with caplog.at_level(logging.WARNING, logger="kvpilot.runtime.layers.attention"):
        assert resolve_attention_backend("auto", "cpu", torch.float16) == "torch"
    assert "float16" in caplog.text


def test_unknown_backend_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        resolve_attention_backend("flash", "cuda")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineArgs(model=str(tiny_llama_dir), attention_backend="flash").create_engine_config()
