"""The door every request passes: 503 while draining or dead, 401 without a valid key, 429 over a
tenant's concurrency limit; it counts requests in flight for the SIGTERM drain.

A plain ASGI middleware, so that it sees a streamed response to its very end: the tenant's slot
and the in-flight count are released when the last byte is sent or the client goes away.
"""

from __future__ import annotations

import asyncio

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpilot.runtime.server.auth import Authenticator
from kvpilot.runtime.server.errors import APIError
from kvpilot.runtime.server.state import ServerState
from kvpilot.runtime.server.tenants import Tenant, TenantRegistry

# Requests that occupy one of a tenant's concurrent slots.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# Answered whatever the state, so that probes and scrapes see the truth while draining or dead.
OBSERVATION_PATHS = frozenset({"/health", "/metrics", "/version"})


class AdmissionMiddleware:
    def __init__(self, app: ASGIApp, state: ServerState, authenticator: Authenticator,
                 tenants: TenantRegistry | None) -> None:
        self.app = app
        self.state = state
        self.authenticator = authenticator
        self.tenants = tenants

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OBSERVATION_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            tenant, holds_slot = self._admit(scope)
        except APIError as err:
            await err.response()(scope, receive, send)
            return
        # Routes read it as request.state.tenant.
        scope.setdefault("state", {})["tenant"] = tenant
        response_started = False

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            response_started = True
            await send(message)

        self.state.request_started()
        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if not self.state.aborting:
                raise
            # The drain's own cancellation, past --shutdown-timeout: answer it if we still can
            # (a stream already under way just ends, without its [DONE]).
            asyncio.current_task().uncancel()
            if not response_started:
                error = APIError(503, "the server shut down before this request finished", code="shutting_down")
                await error.response()(scope, receive, send)
        finally:
            self.state.request_finished()
            if holds_slot:
                self.tenants.release(tenant)

    def _admit(self, scope: Scope) -> tuple[Tenant | None, bool]:
        if self.state.dead_reason is not None:
            raise APIError(503, f"the engine is not running: {self.state.dead_reason}", code="engine_dead")
        if self.state.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        path = scope["path"]
        if not path.startswith("/v1"):
            return None, False
        tenant = self.authenticator.authenticate(Headers(scope=scope))
        if tenant is None or path not in GENERATION_PATHS:
            return tenant, False
        if not self.tenants.try_admit(tenant):
            raise APIError(429, f"tenant {tenant.name!r} has {self.tenants.active(tenant.name)} requests "
                                f"in flight, its limit", code="rate_limit_exceeded")
        return tenant, True
