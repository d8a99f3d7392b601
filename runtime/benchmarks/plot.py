"""`kvpilot bench plot`: result JSONs (single runs or sweeps) -> PNG figures, one line per file.

A file's line is labelled by its `label` field, else by its file name, so that two engines or
two settings measured separately land on one figure.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def load_runs(path: Path) -> tuple[str, str | None, list[dict]]:
    """(label, swept parameter or None for a single run, runs) of one result file."""
    data = json.loads(path.read_text())
    if "runs" in data:
        return data.get("label") or path.stem, data["sweep"], data["runs"]
    return data.get("label") or path.stem, None, [data]


def _x(run: dict, swept: str) -> float:
    value = run[swept]
    if value is None:  # no concurrency limit: every request was in flight at once
        return float(run["num_prompts"])
    return float("inf") if value == "inf" else float(value)


def plot_results(paths: list[Path], output_dir: Path) -> list[Path]:
    """throughput.png and latency.png; ValueError when the files sweep different parameters."""
    series = [load_runs(path) for path in paths]
    kinds = {swept for _, swept, _ in series if swept is not None}
    if len(kinds) > 1:
        raise ValueError("the files sweep different parameters (request_rate and max_concurrency); plot them apart")
    swept = kinds.pop() if kinds else "max_concurrency"
    x_label = "max concurrency" if swept == "max_concurrency" else "request rate (req/s; inf drawn last)"
    output_dir.mkdir(parents=True, exist_ok=True)
    written = []

    figure, axis = plt.subplots(figsize=(6, 4))
    for label, _, runs in series:
        _line(axis, sorted((_x(run, swept), run["output_throughput"]) for run in runs), label)
    axis.set(xlabel=x_label, ylabel="output tokens/s", title="Throughput")
    written.append(_save(figure, output_dir / "throughput.png"))

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for metric, title, axis in (("ttft", "Time to first token", axes[0]), ("itl", "Inter-token latency", axes[1])):
        for label, _, runs in series:
            for stat, style in (("median", "-"), ("p99", "--")):
                _line(axis, sorted((_x(run, swept), run[f"{stat}_{metric}_ms"]) for run in runs),
                      f"{label} {stat}", style)
        axis.set(xlabel=x_label, ylabel="ms", title=title)
    written.append(_save(figure, output_dir / "latency.png"))
    return written


def line_figure(path: Path, series: dict[str, list[tuple[float, float]]], *, xlabel: str, ylabel: str,
                title: str, log_x: bool = False, log_y: bool = False) -> Path:
    """One figure, one line per series (a label ending in "p99" or "best" is dashed); the bench/
    scripts draw their comparisons with it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axis = plt.subplots(figsize=(6, 4))
    for label, points in series.items():
        _line(axis, sorted(points), label, "--" if label.endswith(("p99", "best")) else "-")
    if log_x:
        axis.set_xscale("log", base=2)
    if log_y:
        axis.set_yscale("log")
    axis.set(xlabel=xlabel, ylabel=ylabel, title=title)
    return _save(figure, path)


def scatter_figure(path: Path, series: dict[str, list[tuple[float, float]]], *, xlabel: str, ylabel: str,
                   title: str, log_y: bool = False) -> Path:
    """One figure, one set of points per series: for samples in time, such as every token gap of a run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axis = plt.subplots(figsize=(6, 4))
    for label, points in series.items():
        axis.scatter([x for x, _ in points], [y for _, y in points], s=6, alpha=0.6, label=label)
    if log_y:
        axis.set_yscale("log")
    axis.set(xlabel=xlabel, ylabel=ylabel, title=title)
    return _save(figure, path)


def _line(axis, points: list[tuple[float, float]], label: str, style: str = "-") -> None:
    # An infinite rate (all at once) is drawn one step past the largest finite one.
    finite = [x for x, _ in points if x != float("inf")]
    past = (max(finite) * 2 if finite else 1.0)
    xs = [past if x == float("inf") else x for x, _ in points]
    axis.plot(xs, [y for _, y in points], style, marker="o", label=label)


def _save(figure, path: Path) -> Path:
    for axis in figure.axes:
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
