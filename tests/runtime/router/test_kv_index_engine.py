"""A real engine (the tiny model) publishing its KV-cache events to a router's index: the index holds
exactly the hashes the engine cached, and they are the hashes core/hashing.py computes from the
prompt and its cache salt, which is what a router does with a request."""

from __future__ import annotations

import pytest

from kv_event_harness import following, holds, loopback_config, until
from kvpilot.runtime.config import EngineArgs
from kvpilot.runtime.core.hashing import extend_block_hashes
from kvpilot.runtime.engine.core import EngineCore
from kvpilot.runtime.request import Request, SamplingParams

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(300)]

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64


def router_hashes(prompt: list[int], cache_salt: str) -> list[bytes]:
    request = Request("router", prompt, SamplingParams(), cache_salt=cache_salt)
    extend_block_hashes(request, BLOCK_SIZE)
    return request.block_hashes


def run(engine: EngineCore, request_id: str, prompt: list[int], cache_salt: str) -> None:
    # One output token: the prompt's KV is all the engine computes, so its full blocks are all it caches.
    engine.add_request(Request(request_id, prompt, SamplingParams(max_tokens=1), cache_salt=cache_salt,
                               max_model_len=MAX_MODEL_LEN))
    while engine.has_unfinished_requests():
        engine.step()


async def test_the_index_holds_exactly_the_hashes_the_engine_cached(tiny_llama_dir):
    config = loopback_config()
    engine = EngineCore(EngineArgs(model=str(tiny_llama_dir), block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                                   num_gpu_blocks_override=8, kv_events_config=config).create_engine_config())
    try:
        async with following(config, BLOCK_SIZE) as index:
            await until(lambda: index.synced)
            first = list(range(1, 15))
            run(engine, "first", first, cache_salt="tenant-a")
            expected = router_hashes(first, "tenant-a")
            assert len(expected) == 3
            await until(holds(index, expected))
            assert set(engine.kv_cache_manager.cached_block_hashes()) == set(expected)
            # Another tenant's same prompt shares nothing with it.
            assert index.prefix_blocks(router_hashes(first, "tenant-b")) == 0

            # Another prompt takes all seven blocks of the pool: the first prompt's blocks are evicted
            # as the pool reuses them.
            second = list(range(100, 125))
            run(engine, "second", second, cache_salt="tenant-a")
            cached = engine.kv_cache_manager.cached_block_hashes()
            assert not set(expected) & set(cached)
            await until(holds(index, cached))
            assert index.prefix_blocks(router_hashes(second, "tenant-a")) == 6

            async with following(config, BLOCK_SIZE) as late_joiner:
                await until(holds(late_joiner, cached))

            assert engine.reset_prefix_cache()
            await until(holds(index, []))
            assert index.resnapshots == index.bad_messages == 0
    finally:
        engine.shutdown()
