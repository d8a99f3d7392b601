"""The door every request passes: 503 while draining or dead, or on a connection of the reserve
beyond --max-connections (connections.py), 401 without a valid key; it counts
requests in flight for the SIGTERM drain, and every answer by tenant and status
(http_responses.py), and releases the sequences a request took from its tenant's limit (429
beyond it) when the response ends.

A plain ASGI middleware, so that it sees a streamed response to its very end: the tenant's
sequences and the in-flight count are released when the last byte is sent or the client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpilot.runtime.server.auth import AdminToken, Authenticator
from kvpilot.runtime.server.connections import OVER_CAPACITY
from kvpilot.runtime.server.errors import APIError, bad_request, sse_error
from kvpilot.runtime.server.state import ServerState
from kvpilot.runtime.server.tenants import Tenant, TenantRegistry

# Answered whatever the state and without a key, so that probes and scrapes see the truth
# while draining or dead; /kv_events tells routers where this engine's cache events are published
# (sockets that take no key either).
OBSERVATION_PATHS = frozenset({"/health", "/metrics", "/version", "/kv_events"})
# Guarded by the admin token instead of an API key (api_server.py checks it): /admin/*, and vLLM's
# routes that load and unload LoRA adapters.
ADMIN_PREFIX = "/admin/"
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
# Where the admin token is taken in place of an API key, and shows everything (every loaded adapter,
# whichever tenants may use it): request.state.admin is then True.
ADMIN_VIEW_PATHS = frozenset({"/v1/models"})
# What a 429 (or a 503 for want of connections) tells the client to wait: a tenant's sequences,
# and connections, free up as requests finish.
RETRY_AFTER_S = 1


class TenantSequences:
    """The engine sequences (`n` per request) one request holds against its tenant's limit.

    The route acquires them once it knows `n`; the middleware releases them when the response ends.
    """

    def __init__(self, tenants: TenantRegistry | None, tenant: Tenant | None) -> None:
        self.tenants = tenants
        self.tenant = tenant
        self.held = 0

    def acquire(self, n: int) -> None:
        if self.tenant is None:
            return
        limit = self.tenants.limit(self.tenant)
        if limit is not None and n > limit:
            raise bad_request(f"{n} sequences (n for each prompt) are more than tenant {self.tenant.name!r} may "
                              f"run at once ({limit}): lower n, or send fewer prompts", "n")
        if not self.tenants.try_admit(self.tenant, n):
            local = self.tenants.local_limit(self.tenant)
            share = "" if local == limit else f" here, where its share of the fleet's limit of {limit} is {local}"
            raise APIError(429, f"tenant {self.tenant.name!r} has {self.tenants.active(self.tenant.name)} "
                                f"sequences in flight{share or f' and its limit is {limit}'}: {n} more do not fit",
                           code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.held += n

    def release(self) -> None:
        if self.held:
            self.tenants.release(self.tenant, self.held)
            self.held = 0


class AdmissionMiddleware:
    def __init__(self, app: ASGIApp, state: ServerState, authenticator: Authenticator,
                 tenants: TenantRegistry | None,
                 count_response: Callable[[int, Tenant | None], None] = lambda status, tenant: None,
                 admin_token: AdminToken | None = None) -> None:
        """`count_response(status, tenant)` hears the status of every answer it lets through or gives."""
        self.app = app
        self.state = state
        self.authenticator = authenticator
        self.tenants = tenants
        self.count_response = count_response
        self.admin_token = admin_token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OBSERVATION_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            tenant = self._admit(scope)
        except APIError as err:
            self.count_response(err.status_code, None)
            await err.response()(scope, receive, send)
            return
        sequences = TenantSequences(self.tenants, tenant)
        # Routes read them as request.state.tenant and request.state.sequences (and .admin).
        scope.setdefault("state", {}).update(tenant=tenant, sequences=sequences)
        response_started = streaming = False

        async def tracking_send(message: Message) -> None:
            nonlocal response_started, streaming
            if message["type"] == "http.response.start":
                response_started = True
                self.count_response(message["status"], tenant)
                streaming = Headers(raw=message.get("headers", [])).get("content-type", "").startswith(
                    "text/event-stream")
            await send(message)

        self.state.request_started()
        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if not self.state.aborting:
                raise
            # The drain's own cancellation, past --shutdown-timeout: answer it if we still can.
            asyncio.current_task().uncancel()
            error = APIError(503, "the server shut down before this request finished", code="shutting_down")
            if not response_started:
                await error.response()(scope, receive, tracking_send)
            elif streaming:
                # A stream ends with an error event, so the client knows its answer is cut short.
                with contextlib.suppress(RuntimeError, OSError):
                    await send({"type": "http.response.body", "body": sse_error(error).encode(), "more_body": False})
        finally:
            self.state.request_finished()
            sequences.release()

    def _admit(self, scope: Scope) -> Tenant | None:
        if scope.get("extensions", {}).get(OVER_CAPACITY):
            raise APIError(503, "every connection this server takes is open (--max-connections): retry shortly",
                           code="too_many_connections", headers={"Retry-After": str(RETRY_AFTER_S)})
        if self.state.dead_reason is not None:
            raise APIError(503, f"the engine is not running: {self.state.dead_reason}", code="engine_dead")
        if self.state.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        path = scope["path"]
        if path.startswith(ADMIN_PREFIX) or path in ADMIN_PATHS:
            return None
        headers = Headers(scope=scope)
        admin = path in ADMIN_VIEW_PATHS and self.admin_token is not None and self.admin_token.matches(headers)
        scope.setdefault("state", {})["admin"] = admin
        return None if admin else self.authenticator.authenticate(headers)
