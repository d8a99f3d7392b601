"""What every side-by-side benchmark script shares: interleaved repetitions, best/median, and its
report (a markdown table with the command, the machine and the date, plus a JSON of the samples)
written into its results folder, from where `scripts/run_benchmarks.py` splices it into BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPORT_NAME = "report.md"
RESULT_NAME = "result.json"


def interleaved(runs: dict[str, Callable[[int], float]], repetitions: int) -> dict[str, list[float]]:
    """Every run `repetitions` times, round-robin, the order reversed every other round so that no
    side always goes first on a machine whose load drifts. `run(repetition)` returns one sample;
    the repetition index lets it draw prompts of its own, so that no round reuses another's."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for repetition in range(repetitions):
        order = list(runs) if repetition % 2 == 0 else list(reversed(runs))
        for name in order:
            samples[name].append(runs[name](repetition))
    return samples


def best_and_median(samples: Sequence[float], higher_is_better: bool = False) -> tuple[float, float]:
    return (max(samples) if higher_is_better else min(samples)), statistics.median(samples)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _commit(repo: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


class BenchReport:
    """Collects one script run's context at its start; `write` puts the report into `output_dir`.

    Figures are linked relative to `link_root` (the folder of BENCHMARKS.md) when they lie under
    it, so that the spliced report's images resolve there.
    """

    def __init__(self, script: str, output_dir: Path, torch_threads: int | None, link_root: Path) -> None:
        self.output_dir = output_dir
        self.link_root = link_root
        self.command = shlex.join([".venv/bin/python", os.path.relpath(script, link_root), *sys.argv[1:]])
        self.context = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpu": _cpu_model(),
            "cores": os.cpu_count(),
            "torch_threads": torch_threads,
            "commit": _commit(link_root),
            "load_average_at_start": round(os.getloadavg()[0], 1),
        }
        self.started = time.perf_counter()

    def output_path(self, name: str) -> Path:
        """A file in the output folder (created), for a figure or a raw result."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        return self.output_dir / name

    def _link(self, path: Path) -> str:
        try:
            return path.resolve().relative_to(self.link_root.resolve()).as_posix()
        except ValueError:
            return path.resolve().as_posix()

    def write(self, body: str, figures: Sequence[Path], data: dict, headline: str) -> Path:
        """report.md (context line, body, figures) and result.json; prints the report and returns its path."""
        self.context["load_average_at_end"] = round(os.getloadavg()[0], 1)
        self.context["seconds"] = round(time.perf_counter() - self.started, 1)
        c = self.context
        threads = f", torch threads {c['torch_threads']}" if c["torch_threads"] is not None else ""
        lines = [
            f"Command: `{self.command}`",
            "",
            f"Measured {c['date']} at commit {c['commit'] or 'unknown'} on {c['cpu']}, {c['cores']} cores{threads}; "
            f"load average {c['load_average_at_start']} at the start and {c['load_average_at_end']} at the end "
            f"(the machine is shared: above {c['cores']} means other work competed for the cores); "
            f"the run took {c['seconds']} s.",
            "",
            body.strip(),
            "",
            *[f"![{path.stem}]({self._link(path)})" for path in figures],
            "",
            f"Headline: {headline}",
        ]
        self.output_dir.mkdir(parents=True, exist_ok=True)
        report = self.output_dir / REPORT_NAME
        report.write_text("\n".join(lines).rstrip() + "\n")
        (self.output_dir / RESULT_NAME).write_text(
            json.dumps({"command": self.command, **c, "headline": headline,
                        "figures": [self._link(path) for path in figures], **data}, indent=1) + "\n")
        print(report.read_text())
        return report
