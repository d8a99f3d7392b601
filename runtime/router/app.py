"""The router's FastAPI app: the routes of `kvpilot serve`, answered by the replicas behind it.

The server's own middleware guards it (body limit, admission: keys, tenants, drain, connection
reserve), and its errors have the same shape. The generation routes are parsed with the server's
request models, so a malformed request is refused here with the same 400, then tokenized and
hashed to be placed; everything else about a request is the engine's to check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from tokenizers import Tokenizer

from kvpilot.runtime.router.backends import Publish
from kvpilot.runtime.router.held import HeldRequests
from kvpilot.runtime.router.metrics import RouterMetrics
from kvpilot.runtime.router.peers import RouterPeers
from kvpilot.runtime.router.picking import RoutingStrategy
from kvpilot.runtime.router.prompts import PromptHasher
from kvpilot.runtime.router.proxy import Proxy, RouterSettings, Upstream
from kvpilot.runtime.router.replicas import Fleet, fleet_session
from kvpilot.runtime.router.resume import StreamSplice, why_not_resumable
from kvpilot.runtime.server.admission import AdmissionMiddleware
from kvpilot.runtime.server.api_server import kvpilot_version
from kvpilot.runtime.server.auth import TENANT_HEADER, Authenticator
from kvpilot.runtime.server.body_limit import BodyLimitMiddleware
from kvpilot.runtime.server.chat_template import ChatTemplate
from kvpilot.runtime.server.errors import install_error_handlers
from kvpilot.runtime.server.metrics import CONTENT_TYPE
from kvpilot.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from kvpilot.runtime.server.state import ServerState
from kvpilot.runtime.server.tenants import Tenant, TenantRegistry
from kvpilot.runtime.server.tokenizer_pool import TokenizerPool

logger = logging.getLogger(__name__)

# Request headers the replicas need: who is calling, and what the body is.
_FORWARDED_HEADERS = ("authorization", TENANT_HEADER, "content-type")

# A backend source: runs forever, publishing the replicas' list whenever it changes.
BackendSource = Callable[[Publish], Awaitable[None]]


@dataclass
class RouterConfig:
    settings: RouterSettings
    backends: BackendSource
    tokenizer: Tokenizer
    tokenizer_config: dict
    # Subscribe to the replicas' KV-cache events where they publish them.
    kv_events: bool = True
    max_held_requests: int = 1024
    api_key: str | None = None
    tenants: TenantRegistry | None = None
    trust_tenant_header: bool = False
    # The fleet's routers (the same kind of source as the replicas'), where tenant limits are
    # shared out among them; `own_url` is this router as they list it.
    peers: BackendSource | None = None
    own_url: str | None = None


def build_app(config: RouterConfig, state: ServerState) -> FastAPI:
    limits = config.settings.limits
    tokenizers = TokenizerPool(config.tokenizer, limits.tokenizer_pool_size)
    hasher = PromptHasher(tokenizers, ChatTemplate(config.tokenizer_config), config.tenants)
    held = HeldRequests(config.max_held_requests)
    parts: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async with fleet_session() as session:
            fleet = Fleet(session, kv_events=config.kv_events, on_ready=held.release)
            metrics = RouterMetrics(fleet, lambda: len(held))
            parts.update(fleet=fleet, metrics=metrics, proxy=Proxy(fleet, held, session, config.settings, metrics))
            tasks = [asyncio.create_task(config.backends(fleet.update), name="backends")]
            if config.tenants is not None:
                tasks.append(asyncio.create_task(config.tenants.watch(), name="tenants"))
                if config.peers is not None:
                    peers = RouterPeers(config.own_url)
                    config.tenants.limit_share = peers.share
                    tasks.append(asyncio.create_task(config.peers(peers.update), name="peers"))
            yield
            for task in tasks:
                task.cancel()
            await fleet.close()
        tokenizers.shutdown()

    app = FastAPI(title="kvpilot router", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    # The metrics are made with the fleet, when the app starts, before any request arrives.
    def count_response(status: int, tenant: Tenant | None) -> None:
        parts["metrics"].http_responses.count(status, tenant)

    app.add_middleware(AdmissionMiddleware, state=state,
                       authenticator=Authenticator(config.api_key, config.tenants, config.trust_tenant_header),
                       tenants=config.tenants, count_response=count_response)
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_request_body_bytes, timeout_s=limits.body_timeout_s,
                       count_response=count_response)

    async def generate(request: Request, model: type[CompletionRequest | ChatCompletionRequest]) -> Response:
        raw = await request.body()
        body = _parsed(model, raw)
        tenant = request.state.tenant
        fleet: Fleet = parts["fleet"]
        # Only prefix-aware routing reads the block hashes; every strategy breaks ties by the affinity key.
        prefix_aware = config.settings.strategy is RoutingStrategy.PREFIX_AWARE
        block_sizes = {r.block_size for r in fleet.ready() if r.block_size is not None} if prefix_aware else ()
        hashes, affinity_key = await hasher.place(body, tenant, block_sizes)
        # A request holds its tenant's sequences here as on an engine: the router's limit is the tenant's.
        request.state.sequences.acquire(body.n * (len(body.prompts) if isinstance(body, CompletionRequest) else 1))
        priority = body.priority or 0 if tenant is None else tenant.engine_priority(body.priority)
        upstream = Upstream("POST", request.url.path, _forwarded(request), raw, hashes, affinity_key, priority,
                            model=body.model or "")
        proxy: Proxy = parts["proxy"]
        if not body.stream:
            return await proxy.unary(upstream)
        why_not = why_not_resumable(body)
        if why_not is not None:
            return await proxy.stream(upstream, None, why_not)
        # Token ids come back with each chunk, for a resume; the client gets them only if it asked.
        splice = StreamSplice(client_wants_token_ids=body.return_token_ids)
        return await proxy.stream(upstream.with_fields(return_token_ids=True), splice, None)

    async def forward(request: Request) -> Response:
        body = await request.body() if request.method == "POST" else None
        return await parts["proxy"].unary(Upstream(request.method, request.url.path, _forwarded(request), body))

    routes = APIRouter()

    @routes.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, CompletionRequest)

    @routes.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, ChatCompletionRequest)

    routes.add_api_route("/v1/models", forward, methods=["GET"])
    routes.add_api_route("/v1/models/{model_id:path}", forward, methods=["GET"])
    routes.add_api_route("/tokenize", forward, methods=["POST"])
    routes.add_api_route("/detokenize", forward, methods=["POST"])

    @routes.get("/health")
    async def health() -> JSONResponse:
        # Ready with no replica at all: the router is what holds requests while the fleet is at zero.
        fleet: Fleet = parts["fleet"]
        body = {"status": state.status, "replicas": len(fleet.replicas), "replicas_ready": len(fleet.ready())}
        return JSONResponse(body, status_code=200 if state.status == "ok" else 503)

    routes.add_api_route("/version", kvpilot_version, methods=["GET"])

    @routes.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(parts["metrics"].render(), media_type=CONTENT_TYPE)

    app.include_router(routes)
    return app


def _parsed(model: type[BaseModel], raw: bytes) -> BaseModel:
    try:
        return model.model_validate_json(raw)
    except ValidationError as err:
        raise RequestValidationError(err.errors()) from err


def _forwarded(request: Request) -> dict[str, str]:
    return {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}
