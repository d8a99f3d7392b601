"""Sending a request on: pick the replicas, hold while none is ready, fail over before the first
byte, pass a stream through as it comes, and resume it elsewhere when its replica dies.

A request goes to the next replica in rank order when its replica cannot be reached, refuses the
connection, answers 503 (draining, or its engine dead) or answers something that is not the API's
JSON: all before a byte reached the client. After that it is never sent again; a resumable stream
(resume.py) continues on another replica instead, and any other ends with an error event.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

import aiohttp
import msgspec
from fastapi.responses import Response

from kvpilot.runtime.router.held import HeldRequests, HoldQueueFull
from kvpilot.runtime.router.metrics import RouterMetrics
from kvpilot.runtime.router.picking import RoutingStrategy, rank
from kvpilot.runtime.router.replicas import Fleet, Replica
from kvpilot.runtime.router.resume import ReplicaLost, StreamSplice
from kvpilot.runtime.server.errors import APIError, sse_error
from kvpilot.runtime.server.limits import ServerLimits
from kvpilot.runtime.server.streaming import StallingStreamingResponse

logger = logging.getLogger(__name__)

# Connecting is quick or the replica is gone; an answer takes as long as generation takes.
UPSTREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=3.0)
# What a 503 for want of a replica tells the client to wait.
RETRY_AFTER_S = 5
_API_CONTENT_TYPES = ("application/json", "text/event-stream")
# Answer headers the client gets as the replica sent them.
_PASSED_HEADERS = ("content-type", "retry-after")


@dataclass(frozen=True)
class RouterSettings:
    strategy: RoutingStrategy
    bounded_load_factor: float
    hold_timeout_s: float
    limits: ServerLimits


@dataclass(frozen=True)
class Upstream:
    """One request as the replicas get it, and what places it."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes | None = None
    # The prompt's block hashes by block size, and the key that places it where no cache says.
    prompt_hashes: dict[int, list[bytes]] | None = None
    affinity_key: bytes = b""
    # The engine's order: lower first.
    priority: int = 0
    # The request's model field: the base model, or a LoRA adapter that some replicas hold.
    model: str = ""

    def with_fields(self, **fields) -> "Upstream":
        """The same request with these JSON body fields set (the request asked for their values or not)."""
        body = msgspec.json.decode(self.body)
        body.update(fields)
        return replace(self, body=msgspec.json.encode(body))


class Proxy:
    def __init__(self, fleet: Fleet, held: HeldRequests, session: aiohttp.ClientSession,
                 settings: RouterSettings, metrics: RouterMetrics) -> None:
        self.fleet = fleet
        self.held = held
        self.session = session
        self.settings = settings
        self.metrics = metrics
        self._turns = itertools.count()

    async def unary(self, upstream: Upstream) -> Response:
        """The first whole answer a replica gives; a replica lost while answering is a failure
        before the first byte too, since nothing reached the client yet."""
        deadline = self._deadline()
        while True:
            replica, response = await self._open(upstream, deadline)
            try:
                body = await response.read()
            except (aiohttp.ClientError, TimeoutError) as err:
                self._failed(replica, f"lost while answering ({type(err).__name__})")
                continue
            finally:
                response.release()
                replica.in_flight -= 1
            return Response(body, status_code=response.status, headers=_passed(response))

    async def stream(self, upstream: Upstream, splice: StreamSplice | None, why_not: str | None) -> Response:
        """A streamed answer, relayed as it comes; `splice` follows a resumable one (None: `why_not`)."""
        deadline = self._deadline()
        replica, response = await self._open(upstream, deadline)
        if response.status != 200 or not response.headers.get("content-type", "").startswith("text/event-stream"):
            # Refused (a 400, a 429): the answer is a JSON error, passed on as it is.
            try:
                body = await response.read()
            finally:
                response.release()
                replica.in_flight -= 1
            return Response(body, status_code=response.status, headers=_passed(response))
        events = self._relay(upstream, replica, response, splice, why_not)
        return StallingStreamingResponse(events, self.settings.limits.stream_stall_timeout_s,
                                         self.metrics.slow_clients.inc, media_type="text/event-stream")

    async def _relay(self, upstream: Upstream, replica: Replica, response: aiohttp.ClientResponse,
                     splice: StreamSplice | None, why_not: str | None) -> AsyncIterator[bytes]:
        while True:
            try:
                # readany() rather than an iterator over the stream: each layer of async iteration
                # costs the router CPU for every token it relays.
                if splice is None:
                    while data := await response.content.readany():
                        yield data
                    return
                while data := await response.content.readany():
                    if relayed := splice.feed(data):
                        yield relayed
                splice.end()
                return
            except (ReplicaLost, aiohttp.ClientError) as err:
                lost = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            finally:
                # Closed, not released: a stream cut short (the client left) must abort in the engine.
                response.close()
                replica.in_flight -= 1
            self._failed(replica, f"lost mid-stream ({lost})")
            if splice is None:
                yield sse_error(APIError(502, f"the replica serving this stream was lost ({lost}), and the stream "
                                              f"cannot resume elsewhere exactly: {why_not}", code="replica_lost")).encode()
                return
            try:
                replica, response = await self._open(
                    upstream.with_fields(resume_token_ids=splice.token_ids, return_token_ids=True), self._deadline())
            except APIError as err:
                yield sse_error(err).encode()
                return
            if response.status != 200:
                body = await response.read()
                response.release()
                replica.in_flight -= 1
                yield sse_error(APIError(502, f"the stream could not resume: {body[:300].decode(errors='replace')}",
                                         code="replica_lost")).encode()
                return
            self.metrics.resumes.labels(replica.url).inc()
            logger.info("stream resumed on %s after %d tokens", replica.url, len(splice.token_ids))
            splice.resumed()

    # -- picking and sending -----------------------------------------------------------------------

    def _deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.settings.hold_timeout_s

    async def _open(self, upstream: Upstream, deadline: float) -> tuple[Replica, aiohttp.ClientResponse]:
        """The first answer from a replica that is not a failure before its first byte, trying them
        in rank order, and holding while none is ready. The replica's in-flight count is taken."""
        # Released from the hold: the next held request goes once this one is sent (held.py).
        pass_on: Callable[[], None] | None = None
        try:
            while True:
                replicas, pass_on = await self._ranked(upstream, deadline, pass_on)
                for replica in replicas:
                    response = await self._send(replica, upstream, sent=pass_on)
                    if response is not None:
                        return replica, response
                # Every ready replica failed, and is unready now: held until one is ready again.
        finally:
            if pass_on is not None:
                pass_on()

    async def _ranked(self, upstream: Upstream, deadline: float, pass_on: Callable[[], None] | None
                      ) -> tuple[list[Replica], Callable[[], None] | None]:
        """The ready replicas in rank order, after holding while none is; and the `pass_on` of the
        hold's turn, where this request was released from the hold."""
        loop = asyncio.get_running_loop()
        while not (ready := self.fleet.ready()):
            if pass_on is not None:
                pass_on()  # it waits again, behind the others' turns
            try:
                pass_on = await self.held.wait(upstream.priority, max(0.0, deadline - loop.time()))
            except HoldQueueFull as err:
                raise _no_replica(f"no replica is ready and {err}") from None
            if pass_on is None:
                self.metrics.hold_timeouts.inc()
                raise _no_replica(f"no replica became ready within {self.settings.hold_timeout_s:g} s (--hold-timeout)")
        hashes = upstream.prompt_hashes or {}
        states = [replica.state(hashes, upstream.model) for replica in ready]
        order = rank(self.settings.strategy, states, upstream.affinity_key,
                     bounded_load_factor=self.settings.bounded_load_factor, turn=next(self._turns))
        pick = order[0]
        self.metrics.picked(pick)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s %s (priority %d) -> %s; %s", upstream.method, upstream.path, upstream.priority, pick.name, ", ".join(
                f"{s.name}: prefix={s.prefix_blocks} load={s.load} (in flight {s.in_flight}, running {s.running}, "
                f"waiting {s.waiting})" for s in order))
        return [self.fleet.replicas[state.name] for state in order], pass_on

    async def _send(self, replica: Replica, upstream: Upstream, *, sent: Callable[[], None] | None = None
                    ) -> aiohttp.ClientResponse | None:
        """The replica's answer, once its head arrived; `sent` is called as the request goes out
        (replicas.fleet_session traces it)."""
        replica.in_flight += 1
        try:
            response = await self.session.request(upstream.method, replica.url + upstream.path, data=upstream.body,
                                                   headers=upstream.headers, timeout=UPSTREAM_TIMEOUT,
                                                   trace_request_ctx=sent)
        except (aiohttp.ClientError, TimeoutError) as err:
            replica.in_flight -= 1
            self._failed(replica, f"unreachable ({type(err).__name__}: {err})")
            return None
        content_type = response.headers.get("content-type", "")
        if response.status == 503 or not content_type.startswith(_API_CONTENT_TYPES):
            response.close()
            replica.in_flight -= 1
            self._failed(replica, f"answered {response.status} ({content_type or 'no content type'})")
            return None
        return response

    def _failed(self, replica: Replica, reason: str) -> None:
        self.fleet.unreachable(replica, reason)
        self.metrics.retries.labels(replica.url).inc()


def _passed(response: aiohttp.ClientResponse) -> dict[str, str]:
    return {name: response.headers[name] for name in _PASSED_HEADERS if name in response.headers}


def _no_replica(message: str) -> APIError:
    return APIError(503, message, code="no_replica_ready", headers={"Retry-After": str(RETRY_AFTER_S)})
