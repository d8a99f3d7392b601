"""`kvpilot simulate`: a run's table, JSON and plots; trace files; usage errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.operator.sim import trace
from kvpilot.runtime.cli import main

EXAMPLE = Path(__file__).parents[3] / "examples" / "sim" / "trace.csv"


def test_a_run_writes_its_table_json_and_plots(tmp_path, capsys):
    result = tmp_path / "result.json"
    assert main(["simulate", "--trace", "two-tenant", "--rate", "10", "--duration", "600", "--max-replicas", "4",
                 "--strategies", "static-mean,kvpilot+fcfs", "--result-json", str(result),
                 "--plot-dir", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "| static-mean |" in table and "| kvpilot+fcfs |" in table and "TTFT p99 s interactive" in table
    written = json.loads(result.read_text())
    assert [s["strategy"] for s in written["summaries"]] == ["static-mean", "kvpilot+fcfs"]
    assert written["summaries"][1]["requests"] == sum(
        written["summaries"][1][k] for k in ("served", "dropped", "timed_out"))
    assert len(written["series"]["kvpilot+fcfs"]["time"]) == 40
    for png in ("timeline.png", "cost_vs_slo.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_multi_turn_run_compares_routings_with_their_prefix_hits(capsys):
    assert main(["simulate", "--trace", "multi-turn", "--rate", "4", "--duration", "120", "--system-tokens", "300",
                 "--strategies", "static-peak", "--routing", "service,prefix-aware"]) == 0
    table = capsys.readouterr().out
    assert "| routing | prefix hits |" in table
    assert "| static-peak | service |" in table and "| static-peak | prefix-aware |" in table


def test_a_trace_file_is_read_in_either_format(tmp_path, capsys):
    csv_trace = trace.read(EXAMPLE)
    lines = EXAMPLE.read_text().splitlines()[1:]
    jsonl = tmp_path / "trace.jsonl"
    jsonl.write_text("".join(json.dumps(dict(zip(trace.COLUMNS, (float(a), b, int(c), int(d))))) + "\n"
                             for a, b, c, d in (line.split(",") for line in reversed(lines))))
    jsonl_trace = trace.read(jsonl)
    def names(loaded: trace.Trace) -> list[str]:
        return [loaded.tenants[code] for code in loaded.tenant.tolist()]

    assert names(csv_trace) == names(jsonl_trace) and names(csv_trace)[:2] == ["interactive", "batch"]
    assert csv_trace.time.tolist() == jsonl_trace.time.tolist() == sorted(csv_trace.time.tolist())
    assert csv_trace.prompt.tolist() == jsonl_trace.prompt.tolist()
    assert main(["simulate", "--trace", str(EXAMPLE), "--tenant-priority", "interactive=1", "--max-replicas", "2",
                 "--strategies", "kvpilot"]) == 0
    assert "| kvpilot |" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--strategies", "hpa"], "unknown strategy hpa"),
    (["--tenant-priority", "interactive"], "must be TENANT=PRIORITY"),
    (["--trace", "no-such-file.csv"], "cannot read no-such-file.csv"),
    (["--profile", "a100"], "not a built-in profile"),
    (["--min-replicas", "5", "--max-replicas", "2"], "must not exceed --max-replicas"),
    (["--trace", "poisson", "--tenant-priority", "batch=1"], "the trace has no tenant batch"),
    (["--rate", "0"], "must be a positive number"),
    (["--rate", "inf"], "argument --rate: must be finite"),
    (["--routing", "sticky"], "unknown routing sticky"),
    (["--system-tokens", "-1"], "must be a non-negative integer"),
    (["--strategies", "kvpilot+zero"], "+zero needs a router"),
])
def test_bad_arguments_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["simulate", "--duration", "10", *args])
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_trace_rows_name_their_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("timestamp,tenant,prompt_tokens,output_tokens\n0,a,10,5\n1,a,0,5\n")
    with pytest.raises(ValueError, match="line 3: timestamp must be >= 0 and the token counts >= 1"):
        trace.read(bad)
    bad.write_text("time,tenant\n0,a\n")
    with pytest.raises(ValueError, match="the header must name timestamp"):
        trace.read(bad)


def test_the_command_line_loads_without_torch_or_kopf():
    code = ("import sys; from kvpilot.runtime.cli import main; "
            "assert main(['simulate', '--duration', '60', '--strategies', 'kvpilot']) == 0; "
            "assert 'torch' not in sys.modules and 'kopf' not in sys.modules, sorted(sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
