"""Fake engine pods for the policy tuner: each serves /health and /admin/scheduling as the engine
does, or misbehaves (slow, not JSON), on a port of its own."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp.web


class FakePod:
    """A pod's /health and /admin/scheduling, as the engine serves them, or misbehaving."""

    def __init__(self, policy: str = "fcfs", *, health_body: str | None = None, delay: float = 0.0,
                 token: str | None = "right") -> None:
        """`token`: the admin token it accepts; None: the token of the engine's Secret (any, here)."""
        self.policy, self.health_body, self.delay, self.token = policy, health_body, delay, token
        self.switches: list[str] = []
        self.tokens: set[str] = set()
        self.health_reads = 0

    async def health(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        self.health_reads += 1
        await asyncio.sleep(self.delay)
        if self.health_body is not None:
            return aiohttp.web.Response(text=self.health_body)
        return aiohttp.web.json_response({"status": "ok", "scheduling_policy": self.policy})

    async def admin(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        self.tokens.add(token)
        if self.token is not None and token != self.token:
            return aiohttp.web.json_response({"error": {"message": "missing or invalid admin token"}}, status=401)
        self.policy = (await request.json())["policy"]
        self.switches.append(self.policy)
        return aiohttp.web.json_response({"scheduling_policy": self.policy})


@contextlib.asynccontextmanager
async def serving(**pods: FakePod) -> AsyncIterator[dict[str, str]]:
    """Each fake pod on its own port; yields pod name -> base URL."""
    runners, urls = [], {}
    for name, pod in pods.items():
        app = aiohttp.web.Application()
        app.router.add_get("/health", pod.health)
        app.router.add_post("/admin/scheduling", pod.admin)
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
