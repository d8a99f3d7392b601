"""`kvpilot bench` without a server: the summary's arithmetic, arrivals, datasets, plots, bad servers."""

from __future__ import annotations

import asyncio
import http.server
import json
import statistics
import threading

import httpx
import pytest

from kvpilot.runtime import cli
from kvpilot.runtime.benchmarks import datasets
from kvpilot.runtime.benchmarks.plot import plot_results
from kvpilot.runtime.benchmarks.results import RequestResult, summarize
from kvpilot.runtime.benchmarks.serve import BenchError, ServeBenchConfig, check_server


def test_summary_uses_vllm_names_and_exact_values():
    results = [
        RequestResult(success=True, prompt_tokens=10, output_tokens=3, ttft=0.1, e2e_latency=0.5, itl=[0.2, 0.2]),
        RequestResult(success=True, prompt_tokens=20, output_tokens=5, ttft=0.3, e2e_latency=1.1, itl=[0.2] * 4),
        RequestResult(success=False, error="HTTP 400: bad"),
    ]
    summary = summarize(results, duration=2.0)
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert (summary["total_input_tokens"], summary["total_output_tokens"]) == (30, 8)
    assert summary["request_throughput"] == 1.0
    assert summary["output_throughput"] == 4.0 and summary["total_token_throughput"] == 19.0
    assert summary["mean_ttft_ms"] == pytest.approx(200.0) and summary["p99_ttft_ms"] == pytest.approx(300.0)
    # TPOT per request: (0.5 - 0.1) / 2 and (1.1 - 0.3) / 4.
    assert summary["mean_tpot_ms"] == pytest.approx(200.0) and summary["median_tpot_ms"] == pytest.approx(200.0)
    assert summary["median_itl_ms"] == pytest.approx(200.0)
    assert summary["p99_e2el_ms"] == pytest.approx(1100.0)


def test_poisson_arrivals_keep_their_mean_rate():
    gaps = list(datasets.arrival_gaps(5.0, 4000, seed=1))
    assert statistics.fmean(gaps) == pytest.approx(1 / 5.0, rel=0.05)
    assert gaps == list(datasets.arrival_gaps(5.0, 4000, seed=1))
    assert set(datasets.arrival_gaps(float("inf"), 10, seed=1)) == {0.0}


def test_shared_prefix_prompts_share_exactly_the_prefix():
    requests = datasets.shared_prefix_dataset(4, prefix_len=30, input_len=5, output_len=7, seed=3)
    prefixes = {" ".join(r.prompt.split()[:30]) for r in requests}
    assert len(prefixes) == 1 and len({r.prompt for r in requests}) == 4
    assert all(len(r.prompt.split()) == 35 and r.output_len == 7 for r in requests)


def test_a_jsonl_dataset_is_read_and_a_bad_line_is_named(tmp_path):
    good = tmp_path / "prompts.jsonl"
    good.write_text('{"prompt": "one", "output_len": 3}\n\n{"prompt": "two"}\n')
    assert [(r.prompt, r.output_len) for r in datasets.file_dataset(good, 3, 9)] == [("one", 3), ("two", 9), ("one", 3)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "one"}\n{"text": "two"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        datasets.file_dataset(bad, 2, 4)


def _run_result(concurrency: int, throughput: float) -> dict:
    result = summarize([RequestResult(success=True, prompt_tokens=4, output_tokens=4, ttft=0.1, e2e_latency=0.4,
                                      itl=[0.1] * 3)], duration=1.0)
    return {**result, "max_concurrency": concurrency, "request_rate": "inf", "num_prompts": 1,
            "output_throughput": throughput}


def test_plot_writes_pngs_from_stored_results(tmp_path):
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"sweep": "max_concurrency", "runs": [_run_result(1, 10.0), _run_result(4, 30.0)]}))
    single = tmp_path / "single.json"
    single.write_text(json.dumps({**_run_result(2, 20.0), "label": "other engine"}))
    written = plot_results([sweep, single], tmp_path / "plots")
    assert [p.name for p in written] == ["throughput.png", "latency.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)


def test_plot_refuses_files_that_sweep_different_things(tmp_path, capsys):
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps({"sweep": "request_rate", "runs": [_run_result(1, 1.0)]}))
    concurrency = tmp_path / "concurrency.json"
    concurrency.write_text(json.dumps({"sweep": "max_concurrency", "runs": [_run_result(1, 1.0)]}))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "plot", str(rates), str(concurrency), "--output-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "sweep different parameters" in capsys.readouterr().err


@pytest.mark.parametrize("status, body, message", [
    (401, {"error": {"message": "no"}}, "refused the API key (401)"),
    (200, {"data": [{"id": "served"}]}, "model 'wanted' is not served at http://fake (it serves: served)"),
    (200, {"unexpected": True}, "is not an OpenAI model list"),
    (503, {"error": {"message": "draining"}}, "answered 503: draining"),
])
def test_a_server_that_cannot_be_benchmarked_is_one_line(status, body, message):
    transport = httpx.MockTransport(lambda request: httpx.Response(status, json=body))
    config = ServeBenchConfig(base_url="http://fake", model="wanted")

    async def check():
        async with httpx.AsyncClient(base_url="http://fake", transport=transport) as client:
            await check_server(client, config)

    with pytest.raises(BenchError) as err:
        asyncio.run(check())
    assert message in str(err.value) and "\n" not in str(err.value)


def test_an_unreachable_server_ends_with_one_line_and_exit_1(capsys):
    code = cli.main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "1"])
    error = capsys.readouterr().err.strip()
    assert code == 1 and error.startswith("kvpilot bench serve: error: cannot reach http://127.0.0.1:9")
    assert "\n" not in error


def test_the_api_key_comes_from_the_environment_and_never_shows_in_help(monkeypatch, capsys):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    with pytest.raises(SystemExit):
        cli.main(["bench", "serve", "--help"])
    help_text = capsys.readouterr().out
    assert "sk-from-env" not in help_text and "default: None" not in help_text
    assert "default: $OPENAI_API_KEY" in help_text

    seen = []

    class Refusing(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.headers.get("Authorization"))
            self.send_response(401)
            self.end_headers()

        def log_message(self, *args):
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            code = cli.main(["bench", "serve", "--base-url", f"http://127.0.0.1:{server.server_port}",
                             "--model", "m", "--num-prompts", "1"])
        finally:
            server.shutdown()
    assert code == 1 and seen == ["Bearer sk-from-env"]
    assert "refused the API key (401)" in capsys.readouterr().err
