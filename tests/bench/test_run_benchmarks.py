"""`make bench`'s splicing: the reports in bench/results/ go between their markers in BENCHMARKS.md
and README.md, nothing else changes, and the committed documents are what the reports say."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "run_benchmarks", Path(__file__).resolve().parents[2] / "scripts" / "run_benchmarks.py")
run_benchmarks = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(run_benchmarks)


def _block(name: str, content: str) -> str:
    begin, end = run_benchmarks._markers(name)
    return f"{begin}\n{content}\n{end}"


def test_splice_replaces_only_between_the_markers():
    text = f"intro\n{_block('a', 'old a')}\nmiddle\n{_block('b', 'old b')}\nend\n"
    new = run_benchmarks.splice(text, {"a": "new a\n", "b": "new b", "absent": "ignored"})
    assert new == f"intro\n{_block('a', 'new a')}\nmiddle\n{_block('b', 'new b')}\nend\n"
    assert run_benchmarks.splice(new, {"a": "new a", "b": "new b"}) == new


def test_a_begin_without_its_end_is_an_error():
    begin, _ = run_benchmarks._markers("a")
    with pytest.raises(ValueError, match="has no"):
        run_benchmarks.splice(f"{begin}\nstale\n", {"a": "x"})


def test_the_documents_quote_the_committed_reports():
    for path, text in run_benchmarks.spliced_documents().items():
        assert path.read_text() == text, f"{path.name} is stale: run `.venv/bin/python scripts/run_benchmarks.py --splice-only`"


def test_every_committed_report_is_quoted_in_benchmarks_md():
    text = run_benchmarks.BENCHMARKS.read_text()
    for name in run_benchmarks.reports():
        assert run_benchmarks._markers(name)[0] in text, f"BENCHMARKS.md does not quote {name}"
