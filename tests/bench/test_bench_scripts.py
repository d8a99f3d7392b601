"""Every script in bench/ runs end to end in a tiny mode, so that none can rot between benchmark runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
TINY_ARGS = {
    "offline_throughput.py": ["--num-prompts", "2", "--new-tokens", "2", "--prefix-len", "24"],
    "serving_throughput.py": ["--num-requests", "2", "--max-tokens", "2"],
    "serving_vs_offline.py": ["--num-streams", "2", "--max-tokens", "2", "--prompt-len", "4", "--repetitions", "1"],
    "chunked_prefill_latency.py": ["--num-decoding", "2", "--decode-prompt-len", "4", "--long-prompt-len", "40",
                                   "--window", "2", "--repetitions", "1", "--settings", "64:0,32:0"],
    # No checkpoint: the kernels run on tiny shapes (under the Triton interpreter without a GPU).
    "kernels.py": ["--tiny"],
    "smollm2_throughput.py": ["--num-prompts", "2", "--new-tokens", "2"],
    # Calibration and the real server both run; the accuracy needs the full run (BENCHMARKS.md).
    "sim_validation.py": ["--short"],
    # Against HEAD, which any checkout has (the default baseline is a fixed older commit).
    "async_scheduling.py": ["--num-prompts", "2", "--new-tokens", "2", "--repeats", "1"],
    "scheduler_overhead.py": ["--baseline", "HEAD", "--running", "4", "8", "--steps", "3", "--repeats", "1"],
}
MODEL_FREE = {"kernels.py", "scheduler_overhead.py"}


def test_every_script_has_a_tiny_mode():
    assert {path.name for path in BENCH.glob("*.py")} == set(TINY_ARGS)


@pytest.mark.parametrize("script", sorted(TINY_ARGS))
def test_the_script_runs_and_prints_its_table(script, tiny_llama_dir):
    model = [] if script in MODEL_FREE else ["--model", str(tiny_llama_dir)]
    result = subprocess.run([sys.executable, str(BENCH / script), *model, *TINY_ARGS[script]],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| workload |" in result.stdout and "x |" in result.stdout
