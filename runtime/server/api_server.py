"""The FastAPI app, wired to one AsyncLLM: the OpenAI routes, the utility routes and the admin routes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TypeVar
from importlib.metadata import PackageNotFoundError, version

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError

from kvpilot.runtime.config import KVEventsConfig
from kvpilot.runtime.engine.async_llm import AsyncLLM
from kvpilot.runtime.engine.core_client import EngineDeadError
from kvpilot.runtime.lora.request import LoRARequest
from kvpilot.runtime.server.admission import AdmissionMiddleware
from kvpilot.runtime.server.auth import AdminToken, Authenticator
from kvpilot.runtime.server.body_limit import BodyLimitMiddleware
from kvpilot.runtime.server.chat import create_chat_completion
from kvpilot.runtime.server.chat_template import ChatTemplate
from kvpilot.runtime.server.completions import create_completion
from kvpilot.runtime.server.errors import APIError, bad_request, install_error_handlers
from kvpilot.runtime.server.limits import ServerLimits
from kvpilot.runtime.server.lora_adapters import ServedAdapters
from kvpilot.runtime.server.lora_metrics import LoRAMetrics
from kvpilot.runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from kvpilot.runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    SchedulingPolicyRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from kvpilot.runtime.server.serving import Serving, engine_dead_error
from kvpilot.runtime.server.state import ServerState
from kvpilot.runtime.server.tenants import TenantRegistry
from kvpilot.runtime.server.tokenizer_pool import TokenizerPool
from kvpilot.runtime.server.tool_use import ToolSettings

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=BaseModel)

# A scrape refreshes the engine gauges first, but never waits long on a busy or stuck engine.
STATS_REFRESH_TIMEOUT_S = 2.0


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    tenants: TenantRegistry | None = None
    # None: /admin/* answers 404.
    admin_token: AdminToken | None = None
    trust_tenant_header: bool = False
    # Request defaults from the model's generation_config.json (--generation-config).
    sampling_defaults: dict = field(default_factory=dict)
    limits: ServerLimits = ServerLimits()
    tools: ToolSettings = ToolSettings()
    # LoRA adapters loaded at start (--lora-modules), as (name, path).
    lora_modules: list[tuple[str, str]] = field(default_factory=list)


def build_app(engine: AsyncLLM, config: ServerConfig, state: ServerState) -> FastAPI:
    tokenizers = TokenizerPool(engine.tokenizer, config.limits.tokenizer_pool_size)
    serving = Serving(engine, config.served_model_name, config.tenants, config.limits, tokenizers,
                      config.sampling_defaults)
    template = ChatTemplate(engine.tokenizer_config)
    metrics = ServerMetrics(config.served_model_name, engine.block_size, engine.num_kv_blocks,
                            http_requests_in_flight=lambda: state.in_flight, max_model_len=engine.max_model_len)
    engine.add_stat_logger(metrics)
    if engine.config.lora.enable_lora:
        metrics.registry.register(LoRAMetrics(lambda: engine.latest_stats, engine.config.lora.max_loras))
    serving.on_slow_client = metrics.count_slow_client
    engine.on_engine_dead(state.mark_dead)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # A first utility call starts the engine client's output thread, which is also what
        # notices an engine that dies while no request is running.
        metrics.record_engine_stats(await engine.get_stats())
        for name, path in config.lora_modules:
            try:
                await serving.adapters.load(name, path)
            except APIError as err:
                raise RuntimeError(f"--lora-modules {name}={path}: {err}") from None
        watcher = asyncio.create_task(config.tenants.watch()) if config.tenants is not None else None
        yield
        if watcher is not None:
            watcher.cancel()
        tokenizers.shutdown()

    app = FastAPI(title="kvpilot", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)

    async def engine_dead(request: Request, err: EngineDeadError) -> JSONResponse:
        return engine_dead_error(err).response()

    app.add_exception_handler(EngineDeadError, engine_dead)
    app.add_middleware(AdmissionMiddleware, state=state,
                       authenticator=Authenticator(config.api_key, config.tenants, config.trust_tenant_header),
                       tenants=config.tenants, count_response=metrics.http_responses.count,
                       admin_token=config.admin_token)
    # Outermost: an oversized body is refused before anything else looks at the request.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.limits.max_request_body_bytes,
                       timeout_s=config.limits.body_timeout_s, count_response=metrics.http_responses.count)
    app.include_router(_openai_routes(serving, template, config.tools))
    app.include_router(_utility_routes(serving, template, state, metrics))
    app.include_router(_admin_routes(engine, config.admin_token, metrics))
    app.include_router(_lora_routes(serving.adapters, config.admin_token))
    app.include_router(_kv_events_routes(engine))
    return app


def _openai_routes(serving: Serving, template: ChatTemplate, tools: ToolSettings) -> APIRouter:
    """The OpenAI API: completions, chat completions, models."""
    router = APIRouter()
    engine = serving.engine
    created = int(time.time())

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, request, serving)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(body, request, serving, template, tools)

    card = {
        "id": serving.model_name, "object": "model", "created": created, "owned_by": "kvpilot",
        # vLLM's root is the model as the user named it; here that is the served name, never a path.
        "root": serving.model_name, "parent": None, "max_model_len": engine.max_model_len,
        # Where a request leaves a sampling field out, this is what it gets instead of OpenAI's default.
        "sampling_defaults": serving.sampling_defaults,
    }

    def adapter_card(lora: LoRARequest) -> dict:
        # As vLLM lists an adapter: its root is where it was loaded from, its parent the base model.
        return {**card, "id": lora.lora_name, "root": lora.lora_path, "parent": serving.model_name}

    @router.get("/v1/models")
    async def models(request: Request) -> dict:
        adapters = serving.adapters.visible(request.state.tenant, everything=request.state.admin)
        return {"object": "list", "data": [card] + [adapter_card(lora) for lora in adapters]}

    # `path`: a served name may hold slashes ("org/model"), as Hugging Face names do.
    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        lora = serving.check_model(model_id, request.state.tenant)
        return card if lora is None else adapter_card(lora)

    return router


def _utility_routes(serving: Serving, template: ChatTemplate, state: ServerState,
                    metrics: ServerMetrics) -> APIRouter:
    """vLLM's extras around the OpenAI API: tokenizer, health, version, Prometheus metrics."""
    router = APIRouter()
    engine = serving.engine
    tokenizers = serving.tokenizers

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> Response:
        serving.check_model(body.model, request.state.tenant)
        if body.prompt is not None:
            tokens = await tokenizers.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            tools = None if body.tools is None else [tool.as_template_input() for tool in body.tools]
            tokens = await serving.chat_prompt_token_ids(template, body.messages, tools=tools,
                                                         add_generation_prompt=body.add_generation_prompt)
        # Encoded on the pool too: a long token list is slow to turn into JSON.
        answer = {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}
        return Response(await tokenizers.run(msgspec.json.encode, answer), media_type="application/json")

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
        serving.check_model(body.model, request.state.tenant)
        bad = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise bad_request(f"token ids out of the vocabulary (size {engine.vocab_size}): {bad[:5]}", "tokens")
        # Special tokens are kept: detokenize(tokenize(text)) shows exactly what the model sees.
        return {"prompt": await tokenizers.decode(body.tokens, skip_special_tokens=False)}

    @router.get("/health")
    async def health() -> JSONResponse:
        # The policy the engine last reported: the engine is the one place it is kept.
        body = {"status": state.status, "scheduling_policy": engine.latest_stats.scheduling_policy}
        if state.dead_reason is not None:
            body["reason"] = state.dead_reason
        return JSONResponse(body, status_code=200 if state.status == "ok" else 503)

    router.add_api_route("/version", kvpilot_version, methods=["GET"])

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        with contextlib.suppress(EngineDeadError, TimeoutError):
            metrics.record_engine_stats(await asyncio.wait_for(engine.scrape_stats(), STATS_REFRESH_TIMEOUT_S))
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return router


def _kv_events_routes(engine: AsyncLLM) -> APIRouter:
    """kvpilot's discovery of the engine's KV-cache events, for routers (runtime/router/kv_index.py)."""
    router = APIRouter()

    @router.get("/kv_events")
    async def kv_events() -> dict:
        return kv_events_discovery(engine.config.cache.kv_events_config, engine.block_size)

    return router


def kv_events_discovery(config: KVEventsConfig | None, block_size: int) -> dict:
    """Where the events are published, as configured (a router replaces a wildcard host with the
    engine's); APIError 404 when they are not."""
    if config is None or not config.publishes:
        raise APIError(404, "this engine publishes no KV-cache events (see --kv-events-config)", code="not_found")
    return {"endpoint": config.endpoint, "replay_endpoint": config.replay_endpoint, "topic": config.topic,
            "block_size": block_size}


async def kvpilot_version() -> dict:
    """GET /version, on the server and the router."""
    try:
        return {"version": version("kvpilot")}
    except PackageNotFoundError:
        return {"version": "unknown"}


def _admin_routes(engine: AsyncLLM, admin_token: AdminToken | None, metrics: ServerMetrics) -> APIRouter:
    """Operator-only changes to the live engine, behind the admin token (404 without one)."""
    router = APIRouter()

    @router.post("/admin/scheduling")
    async def set_scheduling_policy(request: Request) -> dict:
        body = await _admin_body(admin_token, request, SchedulingPolicyRequest)
        await engine.set_scheduling_policy(body.policy)
        stats = await engine.get_stats()
        metrics.record_engine_stats(stats)
        logger.info("scheduling policy set to %s", stats.scheduling_policy)
        return {"scheduling_policy": stats.scheduling_policy}

    return router


def _lora_routes(adapters: ServedAdapters, admin_token: AdminToken | None) -> APIRouter:
    """vLLM's routes to load and unload LoRA adapters live, behind the admin token (404 without one)."""
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body = await _admin_body(admin_token, request, LoadLoRAAdapterRequest)
        await adapters.load(body.lora_name, body.lora_path)
        logger.info("loaded LoRA adapter %s from %s", body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body = await _admin_body(admin_token, request, UnloadLoRAAdapterRequest)
        await adapters.unload(body.lora_name)
        logger.info("unloaded LoRA adapter %s", body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router


async def _admin_body(admin_token: AdminToken | None, request: Request, body_type: type[T]) -> T:
    """The body of an admin call; 404 when no admin token is configured, 401 without the token,
    which is checked before the body is even parsed."""
    if admin_token is None:
        raise APIError(404, "no admin token is configured (--admin-token-file)", code="not_found")
    admin_token.check(request.headers)
    try:
        return body_type.model_validate_json(await request.body())
    except ValidationError as err:
        raise RequestValidationError(err.errors()) from err
