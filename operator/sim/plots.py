"""The PNGs: each strategy's replicas and queue over time on one figure, and cost against SLO
attainment. matplotlib is imported here only, when a plot is asked for."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpilot.operator.sim import strategies


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def timeline(series: Mapping[str, Mapping[str, list]], path: Path, title: str) -> None:
    """`series`: strategy -> report.series(run)."""
    pyplot = _pyplot()
    figure, (top, bottom) = pyplot.subplots(2, 1, sharex=True, figsize=(11, 7))
    for name, s in series.items():
        hours = [t / 3600 for t in s["time"]]
        # A pinned-fcfs strategy dashed over its tuned twin, which it often matches.
        style = "--" if name.endswith(strategies.PINNED) else "-"
        (line,) = top.plot(hours, [r + st for r, st in zip(s["ready"], s["starting"])], style, label=name,
                           linewidth=1)
        bottom.plot(hours, s["waiting"], style, color=line.get_color(), linewidth=1)
    top.set_ylabel("replicas (ready + starting)")
    bottom.set_ylabel("requests waiting (fleet)")
    bottom.set_xlabel("hours")
    top.set_title(title)
    top.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)


def cost_vs_slo(summaries: Sequence[Mapping[str, Any]], path: Path, title: str) -> None:
    pyplot = _pyplot()
    figure, axes = pyplot.subplots(figsize=(7, 5))
    # Strategies that land on one point (a tuner that never acted) share one label.
    points: dict[tuple[float, float], list[str]] = {}
    for s in summaries:
        points.setdefault((round(s["replica_hours"], 6), round(100 * s["slo_attainment"], 6)), []).append(s["strategy"])
    for (cost, slo), names in points.items():
        axes.scatter(cost, slo)
        axes.annotate(", ".join(names), (cost, slo), fontsize=7, xytext=(3, 3), textcoords="offset points")
    axes.set_xlabel("replica-hours")
    axes.set_ylabel(f"TTFT within {summaries[0]['ttft_slo_s']:g} s (% of requests)" if summaries else "SLO %")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
