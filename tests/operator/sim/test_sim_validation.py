"""The simulator-vs-real-engine bench in its short mode: both sides produce their figures (the
accuracy itself is measured by the full run and reported in BENCHMARKS.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[3] / "bench" / "sim_validation.py"
FIGURES = ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "mean_waiting")


def test_the_short_mode_reports_each_figure_from_both_sides():
    done = subprocess.run([sys.executable, str(SCRIPT), "--short"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    number = r"(-?[0-9.e+-]+|nan)"
    for figure in FIGURES:
        row = re.search(rf"^\| {figure} \| {number} \| {number} \| ", done.stdout, re.MULTILINE)
        assert row is not None, done.stdout
        real, simulated = float(row.group(1)), float(row.group(2))
        assert real >= 0 and simulated >= 0
    assert '"num_gpu_blocks": 2047' in done.stdout  # the calibrated profile, as written
