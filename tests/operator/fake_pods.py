"""Fake engine pods for the policy tuner and the adapters' loader: each serves /health,
/admin/scheduling and vLLM's LoRA routes (/v1/models, /v1/load_lora_adapter,
/v1/unload_lora_adapter) as the engine does, or misbehaves (slow, not JSON), on a port of its own."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp.web


BASE_MODEL = "qwen"


class FakePod:
    """A pod's /health, /admin/scheduling and LoRA routes, as the engine serves them, or misbehaving."""

    def __init__(self, policy: str = "fcfs", *, health_body: str | None = None, delay: float = 0.0,
                 token: str | None = "right") -> None:
        """`token`: the admin token it accepts; None: the token of the engine's Secret (any, here)."""
        self.policy, self.health_body, self.delay, self.token = policy, health_body, delay, token
        self.switches: list[str] = []
        self.tokens: set[str] = set()
        self.health_reads = 0
        self.adapters: dict[str, str] = {}  # loaded: name -> path
        self.refused: dict[str, str] = {}  # adapter name -> why its load is answered 400
        self.lora_calls: list[str] = []  # "load NAME" / "unload NAME", in order

    def _refused_token(self, request: aiohttp.web.Request) -> aiohttp.web.Response | None:
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        self.tokens.add(token)
        if self.token is not None and token != self.token:
            return aiohttp.web.json_response({"error": {"message": "missing or invalid admin token"}}, status=401)
        return None

    async def health(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        self.health_reads += 1
        await asyncio.sleep(self.delay)
        if self.health_body is not None:
            return aiohttp.web.Response(text=self.health_body)
        return aiohttp.web.json_response({"status": "ok", "scheduling_policy": self.policy})

    async def admin(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        if (refusal := self._refused_token(request)) is not None:
            return refusal
        self.policy = (await request.json())["policy"]
        self.switches.append(self.policy)
        return aiohttp.web.json_response({"scheduling_policy": self.policy})

    async def models(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        if (refusal := self._refused_token(request)) is not None:
            return refusal
        cards = [{"id": BASE_MODEL, "object": "model", "root": BASE_MODEL, "parent": None}]
        cards += [{"id": name, "object": "model", "root": path, "parent": BASE_MODEL}
                  for name, path in self.adapters.items()]
        return aiohttp.web.json_response({"object": "list", "data": cards})

    async def load_adapter(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        if (refusal := self._refused_token(request)) is not None:
            return refusal
        body = await request.json()
        name = body["lora_name"]
        self.lora_calls.append(f"load {name}")
        if name in self.refused:
            message = f"adapter {name!r}: {self.refused[name]}"
            return aiohttp.web.json_response(
                {"error": {"message": message, "type": "BadRequestError", "param": "lora_path", "code": 400}},
                status=400)
        self.adapters[name] = body["lora_path"]
        return aiohttp.web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_adapter(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        if (refusal := self._refused_token(request)) is not None:
            return refusal
        name = (await request.json())["lora_name"]
        self.lora_calls.append(f"unload {name}")
        if self.adapters.pop(name, None) is None:
            return aiohttp.web.json_response(
                {"error": {"message": f"adapter {name!r} is not loaded", "type": "NotFoundError", "code": 404}},
                status=404)
        return aiohttp.web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


@contextlib.asynccontextmanager
async def serving(**pods: FakePod) -> AsyncIterator[dict[str, str]]:
    """Each fake pod on its own port; yields pod name -> base URL."""
    runners, urls = [], {}
    for name, pod in pods.items():
        app = aiohttp.web.Application()
        app.router.add_get("/health", pod.health)
        app.router.add_post("/admin/scheduling", pod.admin)
        app.router.add_get("/v1/models", pod.models)
        app.router.add_post("/v1/load_lora_adapter", pod.load_adapter)
        app.router.add_post("/v1/unload_lora_adapter", pod.unload_adapter)
        runner = aiohttp.web.AppRunner(app)
        await runner.setup()
        site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        urls[name] = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield urls
    finally:
        for runner in runners:
            await runner.cleanup()
