"""`make bench`'s splicing: the reports in bench/results/ go between their markers in BENCHMARKS.md
and README.md, nothing else changes, and the committed documents are what the reports say; the
headline table links each report's section, and BENCHMARKS.md reads as a reference."""

from __future__ import annotations

import importlib.util
import re
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


def test_a_report_is_quoted_without_its_headline_line():
    report = "Command: `x`\n\n| a |\n|---|\n| 1 |\n\nHeadline: 1.4x its peer\n"
    assert run_benchmarks.quoted(report) == "Command: `x`\n\n| a |\n|---|\n| 1 |"


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


def test_anchor_is_githubs_fragment_for_a_heading():
    assert run_benchmarks.anchor("The control loop's read of a pod's page") == "the-control-loops-read-of-a-pods-page"
    assert run_benchmarks.anchor("Routing at 1,000 replicas") == "routing-at-1000-replicas"
    assert run_benchmarks.anchor("The serving sweep on SmolLM2-135M-Instruct") == \
        "the-serving-sweep-on-smollm2-135m-instruct"


def test_the_headline_table_links_each_result_to_the_section_quoting_its_report():
    text = (f"# Benchmarks\n## Engine\n### Offline, by concurrency\n{_block('x/report.md', '')}\n"
            f"## Fleet\n### What the router costs\n{_block('y/report.md', '')}\n")
    results = {"x/report.md": {"headline": "1.4x transformers", "date": "d1"},
               "y/report.md": {"headline": "+0.1 ms ITL", "date": "d2"},
               "z/report.md": {"headline": "not quoted yet", "date": "d3"}}
    rows = run_benchmarks.headline_table(text, results).splitlines()[2:]
    assert rows == ["| 1.4x transformers | d1 | [Offline, by concurrency](#offline-by-concurrency) |",
                    "| +0.1 ms ITL | d2 | [What the router costs](#what-the-router-costs) |",
                    "| not quoted yet | d3 | z/report.md |"]


def test_every_link_inside_benchmarks_md_reaches_a_heading():
    text = run_benchmarks.BENCHMARKS.read_text()
    anchors = {run_benchmarks.anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert links and not set(links) - anchors


def test_benchmarks_md_reads_as_a_reference_not_a_diary():
    """History lives in git: no milestone, branch or session words, no run marked superseded."""
    text = run_benchmarks.BENCHMARKS.read_text()
    found = re.findall(r"\b(?:branch|milestone|stop \d+|issue[ -]\d+|(?:this|last) session|superseded)\b",
                       text, flags=re.IGNORECASE)
    assert not found
