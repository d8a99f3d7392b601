"""`kvpilot serve --kv-events-config`: GET /kv_events says where the engine publishes, without a key,
and a router's index that follows it holds the blocks of a completion's prompt, hashed as the
router hashes them. Without events, GET /kv_events is an OpenAI-shaped 404."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from server_harness import HTTP_TIMEOUT_S, SERVER_API_KEY, ServerProcess, _free_port, start_server
from kvpilot.runtime.core.hashing import extend_block_hashes
from kvpilot.runtime.request import Request, SamplingParams
from kvpilot.runtime.router.kv_index import ReplicaKVIndex
from kvpilot.runtime.server.api_server import kv_events_discovery
from kvpilot.runtime.server.errors import APIError

pytestmark = pytest.mark.timeout(300)

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def publishing_server(tiny_llama_dir, tmp_path_factory) -> ServerProcess:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{_free_port()}",
              "replay_endpoint": f"tcp://127.0.0.1:{_free_port()}", "topic": "kv-events"}
    process = start_server(tiny_llama_dir, tmp_path_factory.mktemp("kv-events-server"), "--api-key", SERVER_API_KEY,
                           "--served-model-name", "tiny", "--block-size", str(BLOCK_SIZE),
                           "--kv-events-config", json.dumps(config))
    yield process
    process.stop()


def router_hashes(prompt: list[int], cache_salt: str) -> list[bytes]:
    request = Request("router", prompt, SamplingParams(), cache_salt=cache_salt)
    extend_block_hashes(request, BLOCK_SIZE)
    return request.block_hashes


async def until(condition) -> None:
    async with asyncio.timeout(30):
        while not condition():
            await asyncio.sleep(0.02)


def test_a_router_finds_the_events_and_holds_the_prompts_blocks(publishing_server):
    discovery = httpx.get(f"{publishing_server.base_url}/kv_events", timeout=HTTP_TIMEOUT_S)
    assert discovery.status_code == 200
    where = discovery.json()
    assert where["topic"] == "kv-events" and where["block_size"] == BLOCK_SIZE
    prompt = list(range(3, 3 + 3 * BLOCK_SIZE + 5))
    expected = router_hashes(prompt, "tenant-a")

    async def follow_a_completion() -> None:
        index = ReplicaKVIndex("engine", where["endpoint"], where["replay_endpoint"], where["topic"], BLOCK_SIZE)
        following = asyncio.create_task(index.run())
        try:
            await until(lambda: index.synced)
            async with httpx.AsyncClient(base_url=publishing_server.base_url, timeout=HTTP_TIMEOUT_S) as http:
                response = await http.post("/v1/completions", headers={"Authorization": f"Bearer {SERVER_API_KEY}"},
                                           json={"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                 "cache_salt": "tenant-a"})
            assert response.status_code == 200, response.text
            await until(lambda: index.num_blocks == 3 and index.prefix_blocks(expected) == 3)
        finally:
            index.close()
            with pytest.raises(asyncio.CancelledError):
                await following

    asyncio.run(follow_a_completion())


def test_without_events_discovery_is_an_openai_404():
    with pytest.raises(APIError) as off:
        kv_events_discovery(None, BLOCK_SIZE)
    assert off.value.status_code == 404
    assert off.value.body()["error"]["code"] == "not_found"
