"""The replicas as the router sees them: which are ready, how loaded, and what their caches hold.

Each replica has one poll task: /health (ready or not), /metrics (the engine's own load), and, once,
/kv_events (where its KV-cache events are published; the subscription then runs beside the poll).
A replica is ready while its source says so (a ready, not terminating endpoint) and its last
health check passed; a request that could not reach it marks it unready until its next good check.
Every problem with a replica is logged once, when it starts, and again only after it went away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.operator.samples import PodSample, Problem, counter_from_page, from_page
from kvpilot.runtime.router.backends import Endpoint
from kvpilot.runtime.router.kv_index import ReplicaKVIndex
from kvpilot.runtime.router.picking import ReplicaState

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.5
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"
LORA_ADAPTER_LOADED = "kvpilot:lora_adapter_loaded"
POLL_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
# A reading of the engine's load older than this says nothing about it any more.
LOAD_STALE_AFTER_S = 5.0
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")


class Replica:
    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.url = endpoint.url
        self.healthy = False
        self.load: PodSample | None = None
        self.kv_index: ReplicaKVIndex | None = None
        # The engine's own vllm:prefix_cache_hits_total (tokens) at the last reading.
        self.prefix_cache_hits: float | None = None
        # The LoRA adapters loaded there at the last reading.
        self.loaded_adapters: frozenset[str] = frozenset()
        # Requests this router sent here that have not finished.
        self.in_flight = 0
        self._problem: str | None = None

    @property
    def ready(self) -> bool:
        return self.healthy and self.endpoint.ready and not self.endpoint.terminating

    @property
    def block_size(self) -> int | None:
        """The block size its cache events are hashed at; None while its index is not in sync."""
        index = self.kv_index
        return index.block_size if index is not None and index.synced else None

    def state(self, prompt_hashes: dict[int, list[bytes]], model: str = "") -> ReplicaState:
        """This replica for one request; `prompt_hashes`: the prompt's block hashes by block size,
        `model`: the request's model field (the base model, or an adapter)."""
        load = self.load if self.load is not None and time.time() - self.load.observed_at < LOAD_STALE_AFTER_S else None
        block_size = self.block_size
        return ReplicaState(
            name=self.url, in_flight=self.in_flight,
            running=0 if load is None else int(load.num_running), waiting=0 if load is None else int(load.num_waiting),
            prefix_blocks=None if block_size is None else self.kv_index.prefix_blocks(prompt_hashes.get(block_size, ())),
            adapter_loaded=model in self.loaded_adapters,
        )

    def problem(self, message: str | None) -> None:
        """Logs `message` if it is new for this replica; None: the replica is well again."""
        if message is not None and message != self._problem:
            logger.warning("replica %s: %s", self.url, message)
        elif message is None and self._problem is not None:
            logger.info("replica %s: well again", self.url)
        self._problem = message


class Fleet:
    """The current replicas, kept in step with the backend source."""

    def __init__(self, session: aiohttp.ClientSession, *, kv_events: bool,
                 on_ready: Callable[[], None] = lambda: None, poll_interval: float = POLL_INTERVAL_S) -> None:
        self.session = session
        self.kv_events = kv_events
        # Called whenever a replica becomes ready: held requests may go now.
        self.on_ready = on_ready
        self.poll_interval = poll_interval
        self.replicas: dict[str, Replica] = {}
        self._tasks: dict[str, list[asyncio.Task]] = {}
        self._no_events_said = False

    def update(self, endpoints: list[Endpoint]) -> None:
        """The source's whole current list: new replicas are polled, gone ones dropped (their
        requests in flight finish, as a terminating one's do)."""
        current = {e.url: e for e in endpoints}
        for url in list(self.replicas):
            if url not in current:
                logger.info("replica %s removed", url)
                del self.replicas[url]
                for task in self._tasks.pop(url):
                    task.cancel()
        for url, endpoint in current.items():
            replica = self.replicas.get(url)
            if replica is None:
                logger.info("replica %s added", url)
                replica = self.replicas[url] = Replica(endpoint)
                self._tasks[url] = [asyncio.create_task(self._poll(replica), name=f"poll {url}")]
            else:
                was_ready = replica.ready
                replica.endpoint = endpoint
                if replica.ready and not was_ready:
                    self.on_ready()

    def ready(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.ready]

    def unreachable(self, replica: Replica, reason: str) -> None:
        """A request found the replica unreachable: no more requests until its health is good again."""
        replica.healthy = False
        replica.problem(reason)

    async def close(self) -> None:
        tasks = [t for group in self._tasks.values() for t in group]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- the poll --------------------------------------------------------------------------------

    async def _poll(self, replica: Replica) -> None:
        while True:
            healthy, problem = await self._check(replica)
            replica.problem(problem)
            was_ready = replica.ready
            replica.healthy = healthy
            if replica.ready and not was_ready:
                self.on_ready()
            await asyncio.sleep(self.poll_interval)

    async def _check(self, replica: Replica) -> tuple[bool, str | None]:
        """(healthy, the problem if any); reads the load and subscribes to the events on the way."""
        try:
            status, body = await self._get(replica, "/health")
            if status != 200:
                return False, f"/health answers {status}"
            if not _says_ok(body):
                # Something else listens there (a web server's page, another service).
                return False, f"/health answers 200 but not as kvpilot serve does: {body[:80]!r}"
            status, page = await self._get(replica, "/metrics")
            if status == 200:
                sample = from_page(replica.url, page, time.time())
                replica.load = sample if isinstance(sample, PodSample) else None
                replica.prefix_cache_hits = counter_from_page(page, PREFIX_CACHE_HITS)
                replica.loaded_adapters = loaded_adapters(page)
                if isinstance(sample, Problem):
                    return True, f"load unknown: {sample.message}"
            if self.kv_events and replica.kv_index is None:
                await self._subscribe(replica)
        except (aiohttp.ClientError, TimeoutError) as err:
            return False, f"unreachable ({type(err).__name__}: {err})"
        return True, None

    async def _get(self, replica: Replica, path: str) -> tuple[int, str]:
        async with self.session.get(replica.url + path, timeout=POLL_TIMEOUT) as response:
            return response.status, await response.text(errors="replace")

    async def _subscribe(self, replica: Replica) -> None:
        async with self.session.get(replica.url + "/kv_events", timeout=POLL_TIMEOUT) as response:
            if response.status == 404:
                if not self._no_events_said:
                    logger.warning("replica %s publishes no KV-cache events (kvpilot serve --kv-events-config): "
                                   "prefix-aware routing places its requests by hashing their first block", replica.url)
                    self._no_events_said = True
                return
            try:
                where = await response.json()
                publisher, replay = (_on_host(where[k], replica.url) for k in ("endpoint", "replay_endpoint"))
                index = ReplicaKVIndex(replica.url, publisher, replay, where["topic"], int(where["block_size"]))
            except (ValueError, KeyError, TypeError, aiohttp.ContentTypeError) as err:
                replica.problem(f"/kv_events answers something else than its endpoints ({err!r:.100})")
                return
        replica.kv_index = index
        self._tasks[replica.url].append(asyncio.create_task(index.run(), name=f"kv events {replica.url}"))


def loaded_adapters(page: str) -> frozenset[str]:
    """The adapters a /metrics page says are loaded (kvpilot:lora_adapter_loaded{lora_name} 1);
    none where it has no such series or is not Prometheus text."""
    lines = "".join(line + "\n" for line in page.splitlines() if line.startswith(LORA_ADAPTER_LOADED))
    try:
        return frozenset(sample.labels["lora_name"] for family in text_string_to_metric_families(lines)
                         for sample in family.samples if sample.value == 1 and "lora_name" in sample.labels)
    except (ValueError, TypeError, IndexError):
        return frozenset()


def _says_ok(body: str) -> bool:
    try:
        answer = json.loads(body)
    except ValueError:
        return False
    return isinstance(answer, dict) and answer.get("status") == "ok"


def _on_host(endpoint: str, replica_url: str) -> str:
    """An endpoint the engine bound on every address (tcp://*:5557), as reached on the replica's host."""
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or not port.isdigit():
        raise ValueError(f"not a tcp://host:port endpoint: {endpoint!r}")
    if host in _WILDCARD_HOSTS:
        host = urlsplit(replica_url).hostname
        host = f"[{host}]" if ":" in host else host
    return f"tcp://{host}:{port}"


@contextlib.asynccontextmanager
async def fleet_session():
    """The router's one HTTP client to the replicas: no pool limit (the router's own connection
    limit bounds it), and no total timeout (a stream lasts as long as it lasts). A request made
    with a callable `trace_request_ctx` has it called as its body goes out (the hold's turns)."""
    connector = aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True)
    sent = aiohttp.TraceConfig()
    sent.on_request_chunk_sent.append(_call_when_sent)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False, trace_configs=[sent]) as session:
        yield session


async def _call_when_sent(_session: aiohttp.ClientSession, context, _params) -> None:
    if callable(context.trace_request_ctx):
        context.trace_request_ctx()
