"""The bench scripts' `kvpilot serve` subprocess: a failure says where the server's log is, and what it said."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvpilot.runtime.benchmarks.local_server import local_server


def _log_path(message: str) -> Path:
    return Path(re.search(r"its log: (\S+)", message).group(1))


def test_a_server_that_does_not_start_shows_its_log(tmp_path):
    with pytest.raises(SystemExit) as failure:
        with local_server(str(tmp_path / "no-such-model")):
            pytest.fail("the block ran without a server")
    message = str(failure.value.code)
    assert "did not start" in message and "exited with status" in message
    log = _log_path(message).read_text()
    assert "no-such-model" in log  # the server's own error, kept on disk...
    assert log.strip().splitlines()[-1] in message  # ...and its end shown


def test_an_error_while_it_serves_carries_its_log(tiny_llama_dir):
    with pytest.raises(RuntimeError) as failure:
        with local_server(str(tiny_llama_dir), "--served-model-name", "tiny"):
            raise RuntimeError("the benchmark failed")
    [note] = failure.value.__notes__
    assert "still running" in note
    assert "Uvicorn running" in _log_path(note).read_text()

