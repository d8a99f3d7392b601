"""Failover before the first byte, and streams resumed after it, against stand-in replicas that
break in the ways real ones do: refused connections, HTML error pages, 503s, streams cut off."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest

from fake_replica import Behaviour, FakeReplica
from server_harness import HTTP_TIMEOUT_S, ServerProcess, _free_port, sse_events, start_server

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def replicas():
    started = [FakeReplica(), FakeReplica()]
    # Round-robin tries them in URL order from the first request on: `first` is tried first.
    started.sort(key=lambda replica: replica.url)
    yield started
    for replica in started:
        replica.stop()


@contextlib.contextmanager
def routed(model_dir, workdir, *backends: str) -> Iterator[ServerProcess]:
    """A round-robin router in front of `backends`, stopped on the way out."""
    flags = [arg for url in backends for arg in ("--backend", url)]
    router = start_server(model_dir, workdir, *flags, "--routing-strategy", "round-robin", "--hold-timeout", "10",
                          subcommand="router")
    try:
        yield router
    finally:
        router.stop()


def stream(router: ServerProcess, **fields) -> list:
    body = {"model": "tiny", "prompt": "a prompt", "max_tokens": 8, "stream": True, **fields}
    with httpx.stream("POST", f"{router.base_url}/v1/completions", json=body, timeout=HTTP_TIMEOUT_S) as response:
        assert response.status_code == 200
        return sse_events(response.iter_lines())


def texts(events: list) -> str:
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events if isinstance(e, dict) and e.get("choices"))


@pytest.mark.parametrize("broken", ["html", "503"])
def test_a_replica_answering_html_or_503_is_passed_over_before_the_first_byte(broken, replicas, tiny_llama_dir,
                                                                              tmp_path):
    bad, good = replicas
    bad.behaviour.mode = broken
    with routed(tiny_llama_dir, tmp_path, bad.url, good.url) as router:
        for _ in range(4):
            response = httpx.post(f"{router.base_url}/v1/completions", json={"model": "tiny", "prompt": "hi"},
                                  timeout=HTTP_TIMEOUT_S)
            assert response.status_code == 200, response.text
        assert bad.requests, "the broken replica was never tried"
        assert len(good.requests) == 4
        assert router.metric("kvpilot:router_retries_total", replica=bad.url) >= 1
        assert f"replica {bad.url}: answered" in router.log()


def test_a_replica_whose_health_page_is_not_kvpilots_gets_nothing(replicas, tiny_llama_dir, tmp_path):
    stranger, good = replicas
    stranger.behaviour.health_html = True
    with routed(tiny_llama_dir, tmp_path, stranger.url, good.url) as router:
        for _ in range(3):
            assert httpx.post(f"{router.base_url}/v1/completions", json={"model": "tiny", "prompt": "hi"},
                              timeout=HTTP_TIMEOUT_S).status_code == 200
        assert not stranger.requests and len(good.requests) == 3
        assert "/health answers 200 but not as kvpilot serve does" in router.log()


def test_a_refused_connection_goes_to_the_next_replica(replicas, tiny_llama_dir, tmp_path):
    good = replicas[0]
    # Nothing listens there: a replica that died between its last health check and this request.
    gone = f"http://127.0.0.1:{_free_port()}"
    with routed(tiny_llama_dir, tmp_path, gone, good.url) as router:
        for _ in range(3):
            assert httpx.post(f"{router.base_url}/v1/completions", json={"model": "tiny", "prompt": "hi"},
                              timeout=HTTP_TIMEOUT_S).status_code == 200
        assert len(good.requests) == 3


def test_a_greedy_stream_cut_mid_way_resumes_on_another_replica_as_one_stream(replicas, tiny_llama_dir, tmp_path):
    first, second = replicas
    first.behaviour.mode = "cut"
    with routed(tiny_llama_dir, tmp_path, first.url, second.url) as router:
        events = stream(router, temperature=0)
        # The client sees every token once, in order, under the first stream's id, and its end.
        assert texts(events) == "".join(f"<{t}>" for t in range(100, 108))
        assert events[-1] == "[DONE]"
        chunks = [e for e in events if isinstance(e, dict)]
        assert {c["id"] for c in chunks} == {f"cmpl-{first.port}"}
        assert {c["created"] for c in chunks} == {first.port}
        # Only the first stream's opening chunk (the role) reached the client, and no token ids it did not ask for.
        assert sum("role" in c["choices"][0]["delta"] for c in chunks) == 1
        assert not any("token_ids" in c["choices"][0] for c in chunks)
        # The second replica went on from the tokens the first had sent.
        assert second.requests[-1]["resume_token_ids"] == [100, 101, 102]
        assert router.metric("kvpilot:router_resumes_total", replica=second.url) == 1


def test_a_client_that_asked_for_token_ids_gets_them_across_a_resume(replicas, tiny_llama_dir, tmp_path):
    first, second = replicas
    first.behaviour.mode = "cut"
    with routed(tiny_llama_dir, tmp_path, first.url, second.url) as router:
        events = stream(router, seed=7, return_token_ids=True)
        ids = [t for e in events if isinstance(e, dict) for t in e["choices"][0].get("token_ids", [])]
        assert ids == list(range(100, 108))


def test_a_sampled_stream_without_a_seed_ends_with_an_error_event_when_cut(replicas, tiny_llama_dir, tmp_path):
    first, second = replicas
    first.behaviour.mode = "cut"
    with routed(tiny_llama_dir, tmp_path, first.url, second.url) as router:
        events = stream(router, temperature=0.8)
        assert texts(events) == "<100><101><102>"
        assert events[-1]["error"]["code"] == "replica_lost"
        assert "samples without a seed" in events[-1]["error"]["message"]
        assert not second.requests, "a stream that cannot resume exactly was sent again"
