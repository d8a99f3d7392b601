"""The client libraries vLLM users already have, unmodified, against a real `kvpilot serve`: the
official `openai` package, LangChain's OpenAI wrappers and litellm. Each goes through the paths
it needs the server to honour: batches of prompts, echo with logprobs, penalties, model lookup."""

from __future__ import annotations

import json
import os
import socket
import time

import h11
import httpx
import openai
import openai._constants
import pytest

from server_harness import HTTP_TIMEOUT_S

PROMPTS = ["The quick brown fox", "A cache keeps", "In 1969"]
MESSAGES = [{"role": "user", "content": "Say it again and again: trains, trains, trains."}]
PENALTIES = {"presence_penalty": 1.5, "frequency_penalty": 1.0}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=HTTP_TIMEOUT_S, max_retries=0)


def _chat_text(http: httpx.Client, **fields) -> str:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **fields}
    return http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]


def test_openai_client_batches_echoes_and_looks_models_up(client, http):
    batch = client.completions.create(model="tiny", prompt=PROMPTS, n=2, max_tokens=6, seed=5,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == list(range(6))
    for p, prompt in enumerate(PROMPTS):
        single = client.completions.create(model="tiny", prompt=prompt, n=2, max_tokens=6, seed=5,
                                           extra_body={"ignore_eos": True})
        assert [c.text for c in single.choices] == [c.text for c in batch.choices[2 * p: 2 * p + 2]]

    # lm-eval's log-likelihood request: echo, logprobs, one token.
    scored = client.completions.create(model="tiny", prompt=PROMPTS[0], echo=True, logprobs=1, max_tokens=1,
                                       temperature=0)
    [choice] = scored.choices
    assert choice.text.startswith(PROMPTS[0])
    prompt_ids = http.post("/tokenize", json={"model": "tiny", "prompt": PROMPTS[0]}).json()["tokens"]
    assert len(choice.logprobs.token_logprobs) == len(prompt_ids) + 1
    assert choice.logprobs.token_logprobs[0] is None
    assert all(isinstance(value, float) for value in choice.logprobs.token_logprobs[1:])

    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, presence_penalty=3)
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model="tiny", prompt="x", suffix="y")

    penalised = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0,
                                               extra_body={"ignore_eos": True, "repetition_penalty": 1.5}, **PENALTIES)
    expected = _chat_text(http, repetition_penalty=1.5, **PENALTIES)
    assert penalised.choices[0].message.content == expected != _chat_text(http)


def test_langchain_openai_batch_sends_one_request_of_many_prompts(server, http):
    from langchain_openai import OpenAI

    sent = []
    recording = httpx.Client(timeout=HTTP_TIMEOUT_S, event_hooks={"request": [lambda r: sent.append(json.loads(r.read()))]})
    llm = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", model="tiny", max_tokens=6, temperature=0,
                 max_retries=0, extra_body={"ignore_eos": True}, http_client=recording)
    texts = llm.batch(PROMPTS)
    assert [body["prompt"] for body in sent] == [PROMPTS]
    expected = [
        http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                           "ignore_eos": True}).json()["choices"][0]["text"]
        for prompt in PROMPTS
    ]
    assert texts == expected


def test_litellm_passes_penalties_through(server, http):
    # Without it, importing litellm fetches a price list from the network.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    response = litellm.completion(
        model="hosted_vllm/tiny", api_base=f"{server.base_url}/v1", api_key="unused", messages=MESSAGES,
        max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.5, timeout=HTTP_TIMEOUT_S, **PENALTIES,
    )
    expected = _chat_text(http, repetition_penalty=1.5, **PENALTIES)
    assert response.choices[0].message.content == expected != _chat_text(http)


def _health_status(sock: socket.socket, conn: h11.Connection) -> int | None:
    """GET /health on `sock`, read through to the end of its response (which may come in several
    segments); its status, or None where the server closed the connection instead."""
    sock.sendall(conn.send(h11.Request(method="GET", target="/health", headers=[("Host", "x")]))
                 + conn.send(h11.EndOfMessage()))
    status = None
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = sock.recv(65536)
            if not data:
                return None
            conn.receive_data(data)
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.EndOfMessage):
            conn.start_next_cycle()
            return status


def test_a_connection_the_openai_pool_would_reuse_is_still_open(server):
    # The SDK reuses a pooled connection until it has been idle for its keep-alive expiry. A
    # server that closed it earlier would reset a request sent on it at that moment (the client
    # sees a ReadError for a request never served): it must keep the connection longer, with a
    # margin for a busy client that marks the connection idle late.
    idle_s = openai._constants.DEFAULT_CONNECTION_LIMITS.keepalive_expiry + 1.0
    url = httpx.URL(server.base_url)
    conn = h11.Connection(h11.CLIENT)
    with socket.create_connection((url.host, url.port), timeout=HTTP_TIMEOUT_S) as sock:
        assert _health_status(sock, conn) == 200
        time.sleep(idle_s)
        assert _health_status(sock, conn) == 200, "the server closed a connection the client may reuse"
