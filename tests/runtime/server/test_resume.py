"""Token ids out (vLLM's return_token_ids) and a stream resumed from its tokens (resume_token_ids),
end to end on the shared `kvpilot serve`.

A resumed stream is checked the way the fleet router splices one: a full stream is cut after its
k-th token (what a client saw before its replica died), the request is sent again with those k
tokens, and the cut stream followed by the resumed one must equal the full stream: token ids, text,
finish reason and usage.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest

from server_harness import HTTP_TIMEOUT_S, assert_openai_error, sse_events

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Tell me about caches."}]
SEEDED = {"temperature": 1.0, "seed": 1234}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S) as client:
        yield client


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    finish_reason: str | None


@dataclass
class Stream:
    chunks: list[Chunk]
    usage: dict

    @property
    def token_ids(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk.token_ids]

    @property
    def text(self) -> str:
        return "".join(chunk.text for chunk in self.chunks)

    @property
    def finish_reason(self) -> str | None:
        return self.chunks[-1].finish_reason

    def cut_after(self, k: int) -> Stream:
        """What a client saw up to (and with) the chunk that brought the k-th token."""
        seen, kept = 0, []
        for chunk in self.chunks:
            if seen == k:
                break
            kept.append(Chunk(chunk.token_ids, chunk.text, None))
            seen += len(chunk.token_ids)
        assert seen == k, "each chunk carries one token at --stream-interval 1"
        return Stream(kept, {})


def _stream(http: httpx.Client, route: str, body: dict) -> Stream:
    body = {"model": "tiny", "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}, **body}
    with http.stream("POST", route, json=body) as response:
        assert response.status_code == 200, response.read()
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    chunks = []
    for event in events[:-2]:
        choice, = event["choices"]
        text = choice["text"] if route == "/v1/completions" else choice["delta"].get("content") or ""
        chunks.append(Chunk(choice.get("token_ids") or [], text, choice["finish_reason"]))
    return Stream(chunks, usage)


def _completion(http: httpx.Client, **fields) -> Stream:
    return _stream(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, **fields})


def _chat(http: httpx.Client, **fields) -> Stream:
    return _stream(http, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 12, "ignore_eos": True,
                                                  **fields})


def _assert_resumes(full: Stream, resume, cuts=(1, 5, 11)) -> None:
    for k in cuts:
        before = full.cut_after(k)
        after = resume(resume_token_ids=before.token_ids)
        assert before.token_ids + after.token_ids == full.token_ids, k
        assert before.text + after.text == full.text, k
        assert after.finish_reason == full.finish_reason, k
        assert after.usage == full.usage, k


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_resumed_completion_stream_continues_the_uninterrupted_one(http, sampling):
    full = _completion(http, **sampling)
    assert len(full.token_ids) == 12 and full.finish_reason == "length"
    _assert_resumes(full, lambda **resume: _completion(http, **sampling, **resume))


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_resumed_chat_stream_continues_the_uninterrupted_one(http, sampling):
    full = _chat(http, **sampling)
    _assert_resumes(full, lambda **resume: _chat(http, **sampling, **resume))


def test_penalties_count_the_resumed_tokens(http):
    penalties = {**SEEDED, "presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3}
    full = _completion(http, **penalties)
    _assert_resumes(full, lambda **resume: _completion(http, **penalties, **resume))
    # The penalties change the tokens, so the resumed ones must have counted for the equality above.
    assert _completion(http, **SEEDED).token_ids != full.token_ids


def _spanning_stop(full: Stream, k: int) -> str:
    """A stop string that first occurs across the end of the k-th token's text."""
    boundary = len(full.cut_after(k).text)
    for start in range(boundary - 1, -1, -1):
        for end in range(boundary + 1, len(full.text) + 1):
            stop = full.text[start:end]
            if full.text.find(stop) == start and stop.strip():
                return stop
    pytest.skip("the tiny model's text has no stop string to place across the boundary")


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_stop_string_across_the_boundary_is_found(http, route):
    generate = (lambda **f: _completion(http, **GREEDY, **f)) if route == "completions" else \
        (lambda **f: _chat(http, **GREEDY, **f))
    k = 5
    stop = _spanning_stop(generate(), k)
    full = generate(stop=stop)
    assert full.finish_reason == "stop" and len(full.token_ids) > k
    # Cut where the stop string has begun but is not complete: its start is held back, unsent.
    _assert_resumes(full, lambda **resume: generate(stop=stop, **resume), cuts=(k,))


def test_min_tokens_count_the_resumed_tokens(http):
    plain = _completion(http, **GREEDY, max_tokens=16).token_ids
    # A token the greedy run first samples at position p >= 4: a stop token there, not before.
    p = next(i for i in range(4, 16) if plain[i] not in plain[:i])
    stop_token = plain[p]
    fields = {**GREEDY, "max_tokens": 16, "stop_token_ids": [stop_token], "min_tokens": p}
    full = _completion(http, **fields)
    assert full.token_ids == plain[:p + 1] and full.finish_reason == "stop"
    # Were only the new tokens counted, the resumed request would mask the stop token at p.
    _assert_resumes(full, lambda **resume: _completion(http, **fields, **resume), cuts=(2, p - 1))


def test_resumed_tokens_that_already_end_the_request_finish_it_at_once(http):
    full = _completion(http, **GREEDY)
    ended = _completion(http, **GREEDY, resume_token_ids=full.token_ids)
    assert ended.token_ids == [] and ended.finish_reason == "length"
    assert ended.usage == full.usage
    # A stop token last, once min_tokens are out.
    stopped = _completion(http, **GREEDY, resume_token_ids=full.token_ids[:4],
                          stop_token_ids=[full.token_ids[3]], min_tokens=4)
    assert stopped.token_ids == [] and stopped.finish_reason == "stop"
    not_yet = _completion(http, **GREEDY, resume_token_ids=full.token_ids[:4],
                          stop_token_ids=[full.token_ids[3]], min_tokens=5)
    assert not_yet.token_ids


def test_the_metrics_count_only_the_tokens_generated_here(server, http):
    before = server.metric("vllm:generation_tokens_total")
    resumed = _completion(http, **GREEDY, resume_token_ids=[5, 6, 7])
    assert resumed.usage["completion_tokens"] == 12
    assert server.metric("vllm:generation_tokens_total") - before == 9


def test_a_non_streamed_resume_answers_what_the_stream_sends(http):
    full = _completion(http, **SEEDED)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, **SEEDED,
            "return_token_ids": True, "resume_token_ids": full.token_ids[:5]}
    answer = http.post("/v1/completions", json=body).json()
    choice = answer["choices"][0]
    assert choice["token_ids"] == full.token_ids[5:]
    assert full.cut_after(5).text + choice["text"] == full.text
    assert answer["usage"] == full.usage


# -- return_token_ids: vLLM's shape ---------------------------------------------------------------


def _tokenized(http: httpx.Client, **prompt) -> list[int]:
    return http.post("/tokenize", json={"model": "tiny", **prompt}).json()["tokens"]


def test_completion_token_ids_in_vllms_places(http):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "n": 2, **SEEDED}
    plain = http.post("/v1/completions", json=body).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]
    answer = http.post("/v1/completions", json={**body, "return_token_ids": True}).json()
    prompt_ids = _tokenized(http, prompt=PROMPT)
    for choice in answer["choices"]:
        assert choice["prompt_token_ids"] == prompt_ids
        assert len(choice["token_ids"]) == 5
    # Streamed: the prompt's ids on each choice's first chunk, each chunk's new tokens on it.
    with http.stream("POST", "/v1/completions", json={**body, "return_token_ids": True, "stream": True}) as r:
        events = sse_events(r.iter_lines())[:-1]
    for index, choice in enumerate(answer["choices"]):
        chunks = [c for e in events for c in e["choices"] if c["index"] == index]
        assert chunks[0]["prompt_token_ids"] == prompt_ids
        assert all("prompt_token_ids" not in c for c in chunks[1:])
        assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]


def test_completion_token_ids_with_echo(http):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, **GREEDY, "echo": True,
            "return_token_ids": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    # The echoed prompt is text only: its ids are the prompt's, not the output's.
    assert choice["text"].startswith(PROMPT) and len(choice["token_ids"]) == 4
    assert choice["prompt_token_ids"] == _tokenized(http, prompt=PROMPT)


def test_chat_token_ids_in_vllms_places(http):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 5, "ignore_eos": True, "n": 2, **SEEDED}
    plain = http.post("/v1/chat/completions", json=body).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    answer = http.post("/v1/chat/completions", json={**body, "return_token_ids": True}).json()
    prompt_ids = answer["prompt_token_ids"]
    assert prompt_ids == _tokenized(http, messages=MESSAGES)
    assert all(len(choice["token_ids"]) == 5 for choice in answer["choices"])
    with http.stream("POST", "/v1/chat/completions",
                     json={**body, "return_token_ids": True, "stream": True}) as r:
        events = sse_events(r.iter_lines())[:-1]
    roles = [e for e in events if e["choices"][0]["delta"].get("role")]
    assert len(roles) == 2 and all(e["prompt_token_ids"] == prompt_ids for e in roles)
    assert all("prompt_token_ids" not in e for e in events if e not in roles)
    for choice in answer["choices"]:
        chunks = [c for e in events if e not in roles for c in e["choices"] if c["index"] == choice["index"]]
        assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]


# -- what a resumed request cannot have ------------------------------------------------------------


@pytest.mark.parametrize("route, fields", [
    ("/v1/completions", {"n": 2}),
    ("/v1/completions", {"prompt": [PROMPT, PROMPT]}),
    ("/v1/completions", {"echo": True}),
    ("/v1/completions", {"structured_outputs": {"regex": "[a-z]+"}}),
    ("/v1/completions", {"resume_token_ids": [1, 10**6]}),
    ("/v1/completions", {"resume_token_ids": list(range(5, 15)), "max_tokens": 9}),
    ("/v1/chat/completions", {"n": 2}),
    ("/v1/chat/completions", {"echo": True}),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
], ids=["n", "prompt-list", "echo", "structured-outputs", "out-of-vocab", "over-max-tokens",
        "chat-n", "chat-echo", "response-format", "tools"])
def test_what_a_resumed_request_cannot_have_is_a_400(http, route, fields):
    prompt = {"prompt": PROMPT} if route == "/v1/completions" else {"messages": MESSAGES}
    body = {"model": "tiny", **prompt, "max_tokens": 12, "resume_token_ids": [5, 6], **fields}
    assert_openai_error(http.post(route, json=body), 400, param="resume_token_ids")
