"""Every script in bench/ runs end to end in a tiny mode, so that none can rot between benchmark runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.runtime.cpu_bf16 import bfloat16_unsupported, cpu_flags

BENCH = Path(__file__).resolve().parents[2] / "bench"
RESULTS = BENCH / "results"
TINY_ARGS = {
    "offline_throughput.py": ["--num-prompts", "2", "--new-tokens", "2", "--prefix-len", "24"],
    "serving_throughput.py": ["--num-requests", "2", "--max-tokens", "2"],
    "serving_vs_offline.py": ["--num-streams", "2", "--max-tokens", "2", "--prompt-len", "4", "--repetitions", "1",
                              "--threads", "1", "--baseline", "HEAD"],
    "chunked_prefill_latency.py": ["--num-decoding", "2", "--decode-prompt-len", "4", "--long-prompt-len", "40",
                                   "--window", "2", "--repetitions", "1", "--settings", "64:0,32:0"],
    # No checkpoint: the kernels run on tiny shapes (under the Triton interpreter without a GPU).
    "kernels.py": ["--tiny"],
    "quant_matmul.py": ["--tiny"],
    "packed_weights.py": ["--batch", "2", "--prompt-len", "8", "--new-tokens", "2", "--repeats", "1"],
    "lora_mixed_batch.py": ["--batch", "4", "--adapters", "2", "--rank", "2", "--prompt-len", "8", "--new-tokens", "2",
                            "--repeats", "1"],
    "attention_options.py": ["--num-reqs", "2", "--num-prefills", "2", "--repeats", "1", "--calls", "1",
                             "--baseline", "HEAD", "--cold"],
    "attention_from_memory.py": ["--tiny", "--kernel", str(BENCH.parent / "kernels/cpu/paged_attention.c")],
    "smollm2_throughput.py": ["--num-prompts", "2", "--new-tokens", "2"],
    "bf16_vs_f32.py": ["--prompt-len", "8", "--prefill-prompts", "1", "--batch-sizes", "1,2", "--new-tokens", "2",
                       "--repetitions", "1"],
    # Calibration and the real server both run; the accuracy needs the full run (BENCHMARKS.md).
    "sim_validation.py": ["--short"],
    # Against HEAD, which any checkout has (the default baseline is a fixed older commit).
    "async_scheduling.py": ["--num-prompts", "2", "--new-tokens", "2", "--repeats", "1"],
    "sim_scale.py": ["--slices", "minute", "--baseline", "HEAD", "--repeats", "1"],
    "operator_page_read.py": ["--baseline", "HEAD", "--repeats", "1", "--calls", "2"],
    "scheduler_overhead.py": ["--baseline", "HEAD", "--running", "4", "8", "--steps", "3", "--repeats", "1"],
    "concurrency_throughput.py": ["--num-prompts", "3", "--new-tokens", "2", "--concurrencies", "2",
                                  "--repetitions", "2", "--threads", "1"],
    "prefix_caching_ttft.py": ["--prefix-lens", "20", "--num-prompts", "2", "--input-len", "2", "--output-len", "2",
                               "--repetitions", "1", "--threads", "1"],
    "chunked_prefill_itl.py": ["--thresholds", "0,16", "--num-streams", "2", "--stream-input-len", "4",
                               "--stream-output-len", "6", "--long-input-len", "40", "--repetitions", "1",
                               "--threads", "1"],
    # The two grammar engines compared on the tiny model's tokenizer.
    "grammar_backends.py": ["--repeats", "1", "--schemas", "3"],
    "serving_sweep.py": ["--concurrencies", "1,2", "--num-prompts", "2", "--input-len", "4", "--output-len", "2",
                         "--threads", "1"],
    "kv_events_cost.py": ["--num-prompts", "4", "--new-tokens", "2", "--max-num-seqs", "2", "--repeats", "1"],
    "router_overhead.py": ["--num-prompts", "2", "--input-len", "4", "--output-len", "3", "--max-concurrency", "2",
                           "--repetitions", "1", "--idle-window", "0.1"],
    # The peer is a second kvpilot server (the report names it so): no llama-server build in tests.
    "llama_cpp_side_by_side.py": ["--stand-in", "--num-prompts", "2", "--rounds", "2", "--input-len", "4", "--output-len", "3",
                                  "--concurrencies", "1,2", "--threads", "1"],
    # Pipeline and tensor parallelism on two ranks, and the bytes across a network namespace (as root).
    "pipeline_parallel.py": ["--batches", "2", "--new-tokens", "2", "--repetitions", "1"],
    "router_prefix_ttft.py": ["--conversations", "2", "--turns", "2", "--words-first-turn", "20",
                              "--words-per-turn", "4", "--output-len", "2", "--max-concurrency", "2",
                              "--repetitions", "1"],
}
MODEL_FREE = {"kernels.py", "quant_matmul.py", "scheduler_overhead.py", "attention_options.py", "attention_from_memory.py",
              "sim_scale.py", "operator_page_read.py"}
# These write a report with figures (kvpilot.runtime.benchmarks.report): the smoke run gives them a
# temporary folder, so that it never overwrites the committed results.
WRITES_REPORT = {"bf16_vs_f32.py", "concurrency_throughput.py", "prefix_caching_ttft.py", "chunked_prefill_itl.py",
                 "serving_sweep.py", "router_overhead.py", "router_prefix_ttft.py", "quant_matmul.py",
                 "llama_cpp_side_by_side.py", "pipeline_parallel.py"}


def test_every_script_has_a_tiny_mode():
    assert {path.name for path in BENCH.glob("*.py")} == set(TINY_ARGS)


def _committed_results() -> dict[Path, int]:
    return {path: path.stat().st_mtime_ns for path in RESULTS.rglob("*") if path.is_file()}


@pytest.mark.parametrize("script", sorted(TINY_ARGS))
def test_the_script_runs_and_prints_its_table(script, tiny_llama_dir, tmp_path):
    if script == "bf16_vs_f32.py" and bfloat16_unsupported(cpu_flags()):
        pytest.skip("this CPU has no BF16 instructions: --dtype bfloat16 is refused here")
    model = [] if script in MODEL_FREE else ["--model", str(tiny_llama_dir)]
    output = ["--output-dir", str(tmp_path)] if script in WRITES_REPORT else []
    before = _committed_results()
    result = subprocess.run([sys.executable, str(BENCH / script), *model, *TINY_ARGS[script], *output],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _committed_results() == before
    if script not in WRITES_REPORT:
        assert "| workload |" in result.stdout and "x |" in result.stdout
        return
    report = (tmp_path / "report.md").read_text()
    assert report in result.stdout
    assert re.search(r"^\|---\|", report, flags=re.MULTILINE) and "Command: `" in report
    assert re.search(r"^Headline: \S", report, flags=re.MULTILINE)
    figures = re.findall(r"!\[[^]]*\]\(([^)]+)\)", report)
    assert figures and all(Path(f).read_bytes().startswith(b"\x89PNG") for f in figures)
    assert (tmp_path / "result.json").is_file()
