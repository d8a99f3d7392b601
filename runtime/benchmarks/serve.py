"""`kvpilot bench serve` and `bench sweep`: stream requests at an OpenAI-compatible server, measure.

Each request is a streaming completion (or chat completion) with `stream_options.include_usage`,
so that token counts are the server's own. Requests start on a Poisson schedule (or all at once)
and at most `max_concurrency` are in flight. Before the timed run, warm-up requests that are not
counted make sure the server has loaded what a first request would pay for.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, replace

import httpx
from tqdm import tqdm

from kvpilot.runtime.benchmarks.datasets import BenchRequest, arrival_gaps, warmup_requests
from kvpilot.runtime.benchmarks.results import RequestResult, summarize

CONNECT_TIMEOUT_S = 10.0
# A single request may legitimately stream for a long time; a stuck server still ends the run.
REQUEST_TIMEOUT_S = 600.0
# The result's per-request lists, beside its summary.
PER_REQUEST_FIELDS = ("input_lens", "output_lens", "ttfts", "itls", "e2els", "errors")


class BenchError(Exception):
    """The benchmark cannot run: the message is the one line the user sees."""


@dataclass(frozen=True)
class ServeBenchConfig:
    base_url: str
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    request_rate: float = math.inf
    max_concurrency: int | None = None
    ignore_eos: bool = False
    num_warmups: int = 1
    seed: int = 0


def _request_body(config: ServeBenchConfig, request: BenchRequest) -> tuple[str, dict]:
    common = {"model": config.model, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    if config.ignore_eos:
        common["ignore_eos"] = True  # vLLM's extension: only sent when asked for
    if config.endpoint == "chat":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": request.prompt}],
                                        "max_completion_tokens": request.output_len}
    return "/v1/completions", {**common, "prompt": request.prompt, "max_tokens": request.output_len}


def _chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def _sent(client: httpx.AsyncClient, request: httpx.Request) -> httpx.Response:
    """The response to `request`, its body still to stream. A server that closes a kept-alive
    connection as the request goes out on it (llama.cpp's server closes one after a few requests)
    is asked once more on a new connection: it answered nothing, so nothing counts twice."""
    try:
        return await client.send(request, stream=True)
    except httpx.RemoteProtocolError:
        return await client.send(request, stream=True)


async def send_request(client: httpx.AsyncClient, config: ServeBenchConfig, request: BenchRequest,
                       first_token: asyncio.Event | None = None) -> RequestResult:
    """One streamed request, timed; `first_token` (if given) is set when its first text arrives."""
    path, body = _request_body(config, request)
    start = last = time.perf_counter()
    result = RequestResult(success=False, sent_at=start)
    try:
        response = await _sent(client, client.build_request("POST", path, json=body))
        try:
            if response.status_code != 200:
                await response.aread()
                return replace(result, error=f"HTTP {response.status_code}: {_error_message(response)}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return replace(result, error=str(chunk["error"].get("message", chunk["error"])))
                now = time.perf_counter()
                if _chunk_text(chunk):
                    if result.ttft is None:
                        result.ttft = now - start
                        if first_token is not None:
                            first_token.set()
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
        finally:
            await response.aclose()
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        return replace(result, error=f"{type(err).__name__}: {err}")
    result.e2e_latency = time.perf_counter() - start
    result.success = True
    return result


def _error_message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


def client_for(config: ServeBenchConfig, max_connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    return httpx.AsyncClient(
        base_url=config.base_url.rstrip("/"), headers=headers,
        timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
        limits=httpx.Limits(max_connections=max_connections),
    )


async def check_server(client: httpx.AsyncClient, config: ServeBenchConfig) -> None:
    """BenchError with a one-line reason unless the server answers and serves `config.model`."""
    try:
        response = await client.get("/v1/models")
    except httpx.HTTPError as err:
        raise BenchError(f"cannot reach {config.base_url}: {err or type(err).__name__}") from None
    if response.status_code == 401:
        raise BenchError(f"{config.base_url} refused the API key (401): pass --api-key")
    if response.status_code != 200:
        raise BenchError(f"{config.base_url}/v1/models answered {response.status_code}: {_error_message(response)}")
    try:
        served = [entry["id"] for entry in response.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise BenchError(f"{config.base_url}/v1/models is not an OpenAI model list") from None
    if config.model not in served:
        raise BenchError(f"model {config.model!r} is not served at {config.base_url} (it serves: {', '.join(served)})")


async def run_benchmark(config: ServeBenchConfig, requests: list[BenchRequest],
                        progress: bool = True) -> tuple[list[RequestResult], float]:
    """Every request's result, in dataset order, and the seconds from the first send to the last answer."""
    limit = config.max_concurrency or len(requests)
    async with client_for(config, max_connections=limit + 1) as client:
        await check_server(client, config)
        for warmup in warmup_requests(config.num_warmups):
            outcome = await send_request(client, config, warmup)
            if not outcome.success:
                raise BenchError(f"the warm-up request failed: {outcome.error}")
        slots = asyncio.Semaphore(limit)
        bar = tqdm(total=len(requests), disable=not progress, desc="requests", unit="req")

        async def limited(request: BenchRequest) -> RequestResult:
            async with slots:
                result = await send_request(client, config, request)
            bar.update()
            return result

        start = time.perf_counter()
        tasks = []
        for request, gap in zip(requests, arrival_gaps(config.request_rate, len(requests), config.seed)):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(request)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return list(results), duration


def benchmark_result(config: ServeBenchConfig, requests: list[BenchRequest], dataset: dict,
                     progress: bool = True) -> dict:
    """Runs the benchmark; the JSON-ready result: settings, the summary, and per-request lists."""
    results, duration = asyncio.run(run_benchmark(config, requests, progress))
    failures = [r.error for r in results if not r.success]
    if len(failures) == len(results):
        raise BenchError(f"every request failed; the first: {failures[0]}")
    settings = asdict(config) | {"api_key": None, "request_rate": _rate_text(config.request_rate)}
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **settings,
        **dataset,
        "num_prompts": len(requests),
        **summarize(results, duration),
        "input_lens": [r.prompt_tokens for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "e2els": [r.e2e_latency for r in results],
        "errors": [r.error for r in results],
    }


def _rate_text(rate: float) -> float | str:
    # JSON has no infinity.
    return "inf" if math.isinf(rate) else rate


def sweep_results(config: ServeBenchConfig, make_requests, dataset: dict, *, request_rates=(), concurrencies=(),
                  progress: bool = True) -> dict:
    """One `bench serve` run per request rate or per concurrency, against the same server.

    `make_requests(seed)` builds each run's prompts from its own seed: a later run never reuses an
    earlier run's prompts, so the server's prefix cache cannot flatter it.
    """
    swept, values = ("request_rate", request_rates) if request_rates else ("max_concurrency", concurrencies)
    runs = []
    for index, value in enumerate(values):
        point = replace(config, **{swept: value}, seed=config.seed + index)
        runs.append(benchmark_result(point, make_requests(point.seed), dataset, progress))
    return {"sweep": swept, "runs": runs}
