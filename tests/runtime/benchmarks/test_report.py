"""The side-by-side helpers of the bench/ scripts: interleaving, best/median, tables, reports, figures."""

from __future__ import annotations

import json

import pytest

from kvpilot.runtime.benchmarks.plot import line_figure, scatter_figure
from kvpilot.runtime.benchmarks.report import BenchReport, best_and_median, interleaved, markdown_table


def test_repetitions_interleave_and_alternate_who_goes_first():
    calls = []

    def run(name):
        return lambda repetition: calls.append((name, repetition)) or len(calls)

    samples = interleaved({"a": run("a"), "b": run("b"), "c": run("c")}, repetitions=3)
    assert calls == [("a", 0), ("b", 0), ("c", 0), ("c", 1), ("b", 1), ("a", 1), ("a", 2), ("b", 2), ("c", 2)]
    assert samples == {"a": [1, 6, 7], "b": [2, 5, 8], "c": [3, 4, 9]}


def test_best_is_the_lowest_time_or_the_highest_throughput():
    assert best_and_median([3.0, 1.0, 2.0, 10.0]) == (1.0, 2.5)
    assert best_and_median([3.0, 1.0, 2.0], higher_is_better=True) == (3.0, 2.0)


def test_markdown_table():
    assert markdown_table(["a", "b"], [[1, "x"]]) == "| a | b |\n|---|---|\n| 1 | x |"


def test_a_report_names_its_command_machine_and_figures(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench/x.py", "--repetitions", "2"])
    out = tmp_path / "bench" / "results" / "x"
    report = BenchReport(str(tmp_path / "bench" / "x.py"), out, torch_threads=2, link_root=tmp_path)
    figure = line_figure(report.output_path("f.png"), {"ours": [(1, 2.0), (4, 3.0)], "ours best": [(1, 2.5)]},
                         xlabel="c", ylabel="tok/s", title="t", log_x=True)
    outside = scatter_figure(tmp_path.parent / f"{tmp_path.name}-outside.png", {"gaps": [(0.1, 5.0), (0.2, 7.0)]},
                             xlabel="s", ylabel="ms", title="t", log_y=True)
    path = report.write("| a |\n|---|\n| 1 |", [figure, outside], {"samples": [1, 2]}, headline="2x faster")
    text = path.read_text()
    assert text.startswith("Command: `.venv/bin/python bench/x.py --repetitions 2`\n")
    assert "torch threads 2" in text and "cores" in text and "load average" in text
    assert "![f](bench/results/x/f.png)" in text and f"]({outside.resolve().as_posix()})" in text
    assert text.rstrip().endswith("Headline: 2x faster")
    data = json.loads((out / "result.json").read_text())
    assert data["headline"] == "2x faster" and data["samples"] == [1, 2] and data["torch_threads"] == 2
    assert {"date", "cpu", "cores", "load_average_at_start", "load_average_at_end", "seconds"} <= set(data)
    assert figure.read_bytes().startswith(b"\x89PNG") and outside.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("samples", [[], [1.0]])
def test_best_and_median_of_few_samples(samples):
    if not samples:
        with pytest.raises(ValueError):
            best_and_median(samples)
    else:
        assert best_and_median(samples) == (1.0, 1.0)
