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


def test_a_file_cut_in_the_header(tmp_path, capsys):
    path = write_gguf(tmp_path / "cut.gguf", _weights())
    path.write_bytes(path.read_bytes()[:60])
    assert "cut.gguf is not a readable GGUF file (truncated or corrupt?)" in _serve_usage_error(capsys, path)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q4_K])
def test_a_file_cut_in_a_tensor_names_it(tmp_path, capsys, qtype):
    path = write_gguf(tmp_path / "cut.gguf", _weights(qtype))
    path.write_bytes(path.read_bytes()[:-7])
    error = _serve_usage_error(capsys, path)
    assert "tensor blk.0.ffn_up.weight in cut.gguf ends at byte" in error and "the file is cut short" in error


def _edit_tensor_info(path, dims: tuple[int, ...] | None = None, type_code: int | None = None) -> None:
    """Rewrite the first tensor's declared dims or type in place (gguf's writer refuses to write either)."""
    data = bytearray(path.read_bytes())
    at = data.index(b"blk.0.ffn_up.weight") + len("blk.0.ffn_up.weight")
    n_dims = int.from_bytes(data[at:at + 4], "little")
    if dims is not None:
        assert len(dims) == n_dims
        for i, n in enumerate(dims):
            data[at + 4 + 8 * i: at + 12 + 8 * i] = n.to_bytes(8, "little")
    if type_code is not None:
        data[at + 4 + 8 * n_dims: at + 8 + 8 * n_dims] = type_code.to_bytes(4, "little")
    path.write_bytes(bytes(data))


def test_an_unknown_type_code_names_the_tensor(tmp_path, capsys):
    path = write_gguf(tmp_path / "u.gguf", _weights(Q.Q8_0))
    _edit_tensor_info(path, type_code=250)
    assert "tensor blk.0.ffn_up.weight in u.gguf has type code 250, which is no GGML type" in \
        _serve_usage_error(capsys, path)


def test_rows_that_are_not_whole_blocks_name_the_tensor(tmp_path, capsys):
    path = write_gguf(tmp_path / "b.gguf", _weights(Q.Q8_0))
    _edit_tensor_info(path, dims=(COLS - 8, ROWS))  # ggml order: the row length first
    assert "tensor blk.0.ffn_up.weight in b.gguf has rows of 248 values, which are not whole blocks of 32 (Q8_0)" \
        in _serve_usage_error(capsys, path)


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
