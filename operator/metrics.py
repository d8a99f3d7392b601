"""The metrics sources: how the control loop reads each ready pod's KV-cache usage and queue.

Two implementations of one small interface, `read(namespace, pods, now) -> Reading`:

- `Prometheus`: PromQL over the HTTP API (`POST /api/v1/query`), one query per metric for all
  of an engine's pods at once, answered per pod; needs no Kubernetes rights at all.
- `DirectScrape`: GET each ready pod's own /metrics (pod IP, container port), all pods at once.

Every HTTP request has a short timeout, so that one slow pod or server holds up only its own
engine's interval, and then only briefly. Nothing here raises on what the other side answers:
a failure becomes a `Problem` in the Reading (samples.py says which).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import aiohttp

from kvpilot.operator import render, samples

Pod = Mapping[str, Any]
# Prometheus's own averaging window for each gauge (see the README).
DEFAULT_WINDOW = "1m"
# The most one request waits for an answer, whatever the interval.
MAX_TIMEOUT_SECONDS = 5.0
_MAX_ANSWER_BYTES = 4 * 1024 * 1024


class MetricsSource(Protocol):
    async def read(self, namespace: str, pods: Sequence[Pod], now: float, *, latencies: bool = False
                   ) -> samples.Reading:
        """A sample or a problem for each of `pods` (ready pods, as the API serves them); with
        `latencies`, their TTFT and ITL histograms too (they triple what a page costs to parse)."""
        ...

    async def read_held(self, namespace: str, routers: Sequence[Pod]) -> float | samples.Problem:
        """The requests that `routers` (ready router pods) hold, summed, or why that is unknown."""
        ...


def request_timeout(interval_seconds: float) -> float:
    """A third of the interval, at most MAX_TIMEOUT_SECONDS: every read ends well before the next."""
    return min(MAX_TIMEOUT_SECONDS, interval_seconds / 3)


def pod_url(pod: Pod) -> str | None:
    """Where a pod's engine serves HTTP: its IP and the engine's container port."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{render.CONTAINER_PORT}"


def pod_metrics_url(pod: Pod) -> str | None:
    base = pod_url(pod)
    return None if base is None else f"{base}/metrics"


def pod_name(pod: Pod) -> str:
    return pod["metadata"]["name"]


class DirectScrape:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        timeout: float,
        url_of: Callable[[Pod], str | None] = pod_metrics_url,
    ) -> None:
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._url_of = url_of

    async def read(self, namespace: str, pods: Sequence[Pod], now: float, *, latencies: bool = False
                   ) -> samples.Reading:
        results = await asyncio.gather(*(self._read_pod(pod, now, latencies) for pod in pods))
        return samples.Reading(
            samples={r.pod: r for r in results if isinstance(r, samples.PodSample)},
            problems={pod_name(pod): r for pod, r in zip(pods, results) if isinstance(r, samples.Problem)},
        )

    async def read_held(self, namespace: str, routers: Sequence[Pod]) -> float | samples.Problem:
        pages = await asyncio.gather(*(self._page(pod) for pod in routers))
        return samples.total_held({
            pod_name(pod): page if isinstance(page, samples.Problem) else samples.held_from_page(pod_name(pod), page)
            for pod, page in zip(routers, pages)
        })

    async def _read_pod(self, pod: Pod, now: float, latencies: bool) -> samples.PodSample | samples.Problem:
        page = await self._page(pod)
        if isinstance(page, samples.Problem):
            return page
        return samples.from_page(pod_name(pod), page, now, latencies=latencies)

    async def _page(self, pod: Pod) -> str | samples.Problem:
        name = pod_name(pod)
        url = self._url_of(pod)
        if url is None:
            return samples.Problem(samples.MISSING, f"pod {name} has no IP yet")
        try:
            async with self._session.get(url, timeout=self._timeout) as response:
                if response.status != 200:
                    return samples.Problem(samples.MISSING, f"pod {name}: GET /metrics answered {response.status}")
                return (await response.content.read(_MAX_ANSWER_BYTES)).decode(errors="replace")
        except (TimeoutError, aiohttp.ClientError) as error:
            return samples.Problem(samples.MISSING, f"pod {name}: GET /metrics failed: {error!r}")


class Prometheus:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        *,
        timeout: float,
        bearer_token: str | None = None,
        window: str = DEFAULT_WINDOW,
    ) -> None:
        self._session = session
        self._query_url = url.rstrip("/") + "/api/v1/query"
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._headers = {"Authorization": f"Bearer {bearer_token}"} if bearer_token else {}
        self._window = window

    async def read(self, namespace: str, pods: Sequence[Pod], now: float, *, latencies: bool = False
                   ) -> samples.Reading:
        names = [pod_name(pod) for pod in pods]
        if not names:
            return samples.Reading()
        wanted = samples.queries(namespace, names, self._window)
        histograms = samples.bucket_queries(namespace, names) if latencies else {}
        answers = await asyncio.gather(*(self._query(query) for query in wanted.values()),
                                       *(self._query(query, samples.bucket_vector) for query in histograms.values()),
                                       return_exceptions=True)
        for answer in answers:
            if isinstance(answer, _Failed):
                return samples.Reading(failure=answer.problem)
            if isinstance(answer, BaseException):
                raise answer
        return samples.from_vectors(names, dict(zip(wanted, answers)), dict(zip(histograms, answers[len(wanted):])))

    async def read_held(self, namespace: str, routers: Sequence[Pod]) -> float | samples.Problem:
        names = [pod_name(pod) for pod in routers]
        if not names:
            return samples.total_held({})
        try:
            answer = await self._query(samples.held_query(namespace, names))
        except _Failed as failed:
            return failed.problem
        return samples.held_from_vector(names, answer)

    async def _query(self, query: str, parse: Callable[[Any], Any] = samples.vector) -> Any:
        # POST: with many pods, the query outgrows what a URL may carry.
        try:
            async with self._session.post(
                self._query_url, data={"query": query}, headers=self._headers, timeout=self._timeout
            ) as response:
                body = await response.content.read(_MAX_ANSWER_BYTES)
                status = response.status
        except (TimeoutError, aiohttp.ClientError) as error:
            raise _Failed(samples.UNREACHABLE, f"{self._query_url}: {error!r}") from error
        if status >= 400:
            raise _Failed(samples.UNREACHABLE, f"{self._query_url} answered {status}: {body[:300]!r}")
        try:
            return parse(json.loads(body))
        except ValueError as error:
            raise _Failed(samples.INVALID, f"{self._query_url} answered {status}: {error}") from error


class _Failed(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.problem = samples.Problem(reason, message)
