"""A stand-in replica for the router's tests: answers as `kvpilot serve` does, or as a broken one
does (HTML, 503, a stream cut off mid-way), on its own thread and event loop."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from dataclasses import dataclass, field

from aiohttp import web

METRICS_PAGE = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="tiny"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="tiny"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="tiny"} 0.0
"""


@dataclass
class Behaviour:
    """What the replica does with a generation request."""

    # "ok", "html" (a proxy's error page), "503" (draining), or "cut" (a stream cut after `tokens_before_cut`).
    mode: str = "ok"
    # The tokens a stream sends, one per event, starting after the request's resume_token_ids.
    tokens: list[int] = field(default_factory=lambda: list(range(100, 108)))
    tokens_before_cut: int = 3
    health_status: int = 200
    # Something else answers /health: a web server's default page.
    health_html: bool = False


class FakeReplica:
    def __init__(self, behaviour: Behaviour | None = None) -> None:
        self.behaviour = behaviour or Behaviour()
        # The JSON bodies of the generation requests it got.
        self.requests: list[dict] = []
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._started.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/kv_events", self._no_kv_events)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._started.set()
        self._loop.run_forever()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=METRICS_PAGE)

    async def _no_kv_events(self, request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "no KV-cache events", "code": "not_found"}}, status=404)

    async def _health(self, request: web.Request) -> web.Response:
        if self.behaviour.health_html:
            return web.Response(text="<html><body>It works!</body></html>", content_type="text/html")
        return web.json_response({"status": "ok"}, status=self.behaviour.health_status)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        mode = self.behaviour.mode
        if mode == "html":
            return web.Response(text="<html><body>502 Bad Gateway</body></html>", status=502, content_type="text/html")
        if mode == "503":
            return web.json_response({"error": {"message": "draining", "code": "shutting_down"}}, status=503)
        done = len(body.get("resume_token_ids") or [])
        tokens = self.behaviour.tokens[done:]
        if not body.get("stream"):
            return web.json_response({"id": "cmpl-fake", "object": "text_completion", "created": 1,
                                      "choices": [{"index": 0, "text": "".join(f"<{t}>" for t in tokens),
                                                   "finish_reason": "length"}]})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(_event({"id": f"cmpl-{self.port}", "created": self.port, "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}))
        for position, token in enumerate(tokens):
            if mode == "cut" and position == self.behaviour.tokens_before_cut:
                # The replica dies: the connection drops with the stream unfinished.
                request.transport.abort()
                return response
            last = position == len(tokens) - 1
            choice = {"index": 0, "delta": {"content": f"<{token}>"}, "finish_reason": "length" if last else None}
            if body.get("return_token_ids"):
                choice["token_ids"] = [token]
            await response.write(_event({"id": f"cmpl-{self.port}", "created": self.port, "choices": [choice]}))
        await response.write(b"data: [DONE]\n\n")
        return response


def _event(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"
