"""A GGUF file the engine cannot run is a usage error of `kvpilot serve` that names the problem."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from gguf_files import write_gguf
from kvpilot.runtime import cli

ROWS, COLS = 4, 256


def _weights(qtype: Q = Q.F32) -> dict:
    if qtype == Q.F32:
        return {"blk.0.ffn_up.weight": (np.ones((ROWS, COLS), dtype=np.float32), qtype)}
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    return {"blk.0.ffn_up.weight": (np.zeros((ROWS, COLS // block_elems * block_bytes), dtype=np.uint8), qtype)}


def _serve_usage_error(capsys, path) -> str:
    with pytest.raises(SystemExit) as raised:
        cli.main(["serve", str(path)])
    assert raised.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("keep", [0.5, 0.05], ids=["in-the-tensors", "in-the-header"])
def test_a_truncated_file(tmp_path, capsys, keep):
    path = write_gguf(tmp_path / "cut.gguf", _weights())
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    error = _serve_usage_error(capsys, path)
    assert "cut.gguf is not a readable GGUF file (truncated or corrupt?)" in error


def test_an_architecture_the_engine_does_not_implement(tmp_path, capsys):
    path = write_gguf(tmp_path / "g.gguf", _weights(), arch="gemma3")
    error = _serve_usage_error(capsys, path)
    assert "g.gguf has architecture 'gemma3', which kvpilot does not implement" in error
    assert "supported GGUF architectures: llama, qwen2" in error


def test_a_quantization_type_gguf_cannot_dequantize(tmp_path, capsys):
    path = write_gguf(tmp_path / "q.gguf", _weights(Q.Q8_K))
    error = _serve_usage_error(capsys, path)
    assert "tensor blk.0.ffn_up.weight in q.gguf is stored as Q8_K, which kvpilot cannot dequantize" in error
    assert "Q4_K" in error  # the list of what is supported


def test_a_missing_file(tmp_path, capsys):
    # serve checks MODEL while parsing (main 6e909cc), before it is opened as GGUF.
    missing = tmp_path / "absent.gguf"
    assert f"argument MODEL: no such folder or file: {missing}" in _serve_usage_error(capsys, missing)


def test_the_console_script_prints_no_traceback(tmp_path):
    path = write_gguf(tmp_path / "g.gguf", _weights(), arch="mamba")
    result = subprocess.run([sys.executable, "-m", "kvpilot.runtime.cli", "serve", str(path)], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2
    assert "architecture 'mamba'" in result.stderr and "Traceback" not in result.stderr
