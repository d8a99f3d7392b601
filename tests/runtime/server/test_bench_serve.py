"""`kvpilot bench serve` and `bench sweep` against a real `kvpilot serve`."""

from __future__ import annotations

import json

from kvpilot.runtime import cli

LOAD = ["--num-prompts", "5", "--input-len", "12", "--output-len", "6", "--ignore-eos", "--num-warmups", "1"]


def _ordered(result: dict, metric: str) -> bool:
    return 0 <= result[f"median_{metric}_ms"] <= result[f"p99_{metric}_ms"]


def test_bench_serve_measures_every_request(server, tmp_path, capsys):
    out = tmp_path / "result.json"
    code = cli.main(["bench", "serve", "--base-url", server.base_url, "--model", "tiny", *LOAD,
                     "--max-concurrency", "3", "--result-json", str(out)])
    assert code == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    result = json.loads(out.read_text())
    for key in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "ttfts", "itls", "e2els", "input_lens",
                "output_lens", "errors", "max_concurrency", "request_rate", "dataset", "num_prompts"):
        assert key in result, key
    assert (result["completed"], result["failed"], result["num_prompts"]) == (5, 0, 5)
    assert result["output_lens"] == [6] * 5 and result["total_output_tokens"] == 30
    assert all(n > 12 for n in result["input_lens"])  # 12 words, and the server counted them as tokens
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert _ordered(result, metric), metric
    assert result["median_ttft_ms"] <= result["median_e2el_ms"]


def test_bench_sweep_runs_each_concurrency_on_its_own_prompts(server, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    code = cli.main(["bench", "sweep", "--base-url", server.base_url, "--model", "tiny", *LOAD, "--endpoint", "chat",
                     "--concurrencies", "1,5", "--result-json", str(out)])
    assert code == 0
    sweep = json.loads(out.read_text())
    assert sweep["sweep"] == "max_concurrency"
    assert [run["max_concurrency"] for run in sweep["runs"]] == [1, 5]
    assert [run["seed"] for run in sweep["runs"]] == [0, 1]
    assert all(run["completed"] == 5 and run["endpoint"] == "chat" for run in sweep["runs"])
