"""The fleet as the router sees it: only a ready, not terminating endpoint whose health is good
takes requests, and a replica becoming ready releases the held ones."""

import asyncio

import pytest

from fake_replica import FakeReplica
from kvpilot.runtime.router.backends import Endpoint
from kvpilot.runtime.router.replicas import Fleet, fleet_session, loaded_adapters


@pytest.fixture
def stand_ins():
    replicas = [FakeReplica(), FakeReplica()]
    yield replicas
    for replica in replicas:
        replica.stop()


async def until(condition, timeout=10.0):
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met")


async def test_only_ready_endpoints_take_requests_and_readiness_releases_held_ones(stand_ins):
    serving, draining = stand_ins
    became_ready = []
    async with fleet_session() as session:
        fleet = Fleet(session, kv_events=False, on_ready=lambda: became_ready.append(True), poll_interval=0.02)
        fleet.update([Endpoint(serving.url), Endpoint(draining.url, terminating=True)])
        await until(lambda: [r.url for r in fleet.ready()] == [serving.url])
        assert len(became_ready) == 1
        # The draining pod comes back as a new one at the same address: it takes requests again.
        fleet.update([Endpoint(serving.url), Endpoint(draining.url)])
        await until(lambda: len(fleet.ready()) == 2)
        assert len(became_ready) == 2
        # Gone from the source: gone from the fleet.
        fleet.update([Endpoint(draining.url)])
        assert [r.url for r in fleet.ready()] == [draining.url]
        await fleet.close()


async def test_a_replica_found_unreachable_waits_for_its_next_good_health_check(stand_ins):
    replica = stand_ins[0]
    async with fleet_session() as session:
        fleet = Fleet(session, kv_events=False, poll_interval=0.02)
        fleet.update([Endpoint(replica.url)])
        await until(lambda: len(fleet.ready()) == 1)
        fleet.unreachable(fleet.replicas[replica.url], "a request's connection was refused")
        assert fleet.ready() == []
        await until(lambda: len(fleet.ready()) == 1)
        replica.behaviour.health_status = 503
        await until(lambda: fleet.ready() == [])
        await fleet.close()


def test_the_loaded_adapters_are_read_from_the_metrics_page():
    page = ('# HELP kvpilot:lora_adapter_loaded A LoRA adapter is loaded.\n# TYPE kvpilot:lora_adapter_loaded gauge\n'
            'kvpilot:lora_adapter_loaded{lora_name="sql"} 1.0\nkvpilot:lora_adapter_loaded{lora_name="old"} 0.0\n'
            'vllm:num_requests_running{model_name="qwen"} 2.0\n')
    assert loaded_adapters(page) == {"sql"}
    assert loaded_adapters("<html>") == frozenset() and loaded_adapters("") == frozenset()
