"""The fields vLLM users rely on, end to end on a real `kvpilot serve`: batches of prompts, echo,
penalties and token restrictions, /v1/models/{id}, and the errors for what a text model cannot take."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.engine.bad_words import bad_words_token_ids

from server_harness import HTTP_TIMEOUT_S, assert_openai_error, sse_events, wait_until

PROMPTS = ["The quick brown fox", "A cache keeps", "In 1969"]
TOKEN_PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12]]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir))


def _body(**fields) -> dict:
    return {"model": "tiny", "max_tokens": 8, "ignore_eos": True, **fields}


def test_a_batch_of_prompts_numbers_each_prompts_choices_as_openai_does(http):
    # Seeded sampling: each choice is reproducible alone, whatever else is in the batch.
    body = _body(prompt=PROMPTS, n=2, seed=123, temperature=1.0)
    batch = http.post("/v1/completions", json=body).json()
    assert [c["index"] for c in batch["choices"]] == list(range(6))
    usage = 0
    for p, prompt in enumerate(PROMPTS):
        single = http.post("/v1/completions", json={**body, "prompt": prompt}).json()
        assert [c["text"] for c in single["choices"]] == [batch["choices"][p * 2 + i]["text"] for i in range(2)]
        usage += single["usage"]["prompt_tokens"]
    assert batch["usage"]["prompt_tokens"] == usage
    assert batch["usage"]["completion_tokens"] == 6 * 8
    # Streamed, the same choices arrive interleaved under the same indexes.
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        events = sse_events(response.iter_lines())
    streamed = [""] * 6
    for event in events[:-1]:
        for choice in event["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert streamed == [c["text"] for c in batch["choices"]]


def test_a_batch_of_token_id_prompts(http):
    body = _body(prompt=TOKEN_PROMPTS, temperature=0)
    batch = http.post("/v1/completions", json=body).json()
    singles = [http.post("/v1/completions", json={**body, "prompt": p}).json()["choices"][0] for p in TOKEN_PROMPTS]
    assert [(c["index"], c["text"]) for c in batch["choices"]] == [(i, c["text"]) for i, c in enumerate(singles)]
    assert batch["usage"]["prompt_tokens"] == sum(map(len, TOKEN_PROMPTS))


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_whose_client_goes_away_is_aborted_whole(server, stream):
    aborted = server.metric("vllm:request_success_total", finished_reason="abort")
    body = _body(prompt=PROMPTS, n=2, max_tokens=1500, stream=stream)
    with httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(HTTP_TIMEOUT_S, read=1.0)) as client:
        if stream:
            # One chunk read, then the connection closes.
            with client.stream("POST", "/v1/completions", json=body) as response:
                next(response.iter_bytes())
        else:
            with pytest.raises(httpx.ReadTimeout):
                client.post("/v1/completions", json=body)
    wait_until(lambda: server.metric("vllm:request_success_total", finished_reason="abort") == aborted + 6,
               what="all six choices to be aborted")
    wait_until(lambda: server.metric("vllm:num_requests_running") == 0, what="the engine to drop them")


def test_a_batch_over_max_n_is_refused(http):
    error = assert_openai_error(http.post("/v1/completions", json=_body(prompt=["a"] * 65, n=2)), 400, param="prompt")
    assert "--max-n" in error["message"]


def test_echo_with_logprobs_puts_the_prompts_logprobs_first(http, llm):
    prompt = "To bake a simple loaf of bread"
    reference = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    ids = reference.prompt_token_ids
    body = http.post("/v1/completions", json=_body(prompt=prompt, echo=True, logprobs=2, max_tokens=3,
                                                   temperature=0)).json()
    [choice] = body["choices"]
    plain = http.post("/v1/completions", json=_body(prompt=prompt, max_tokens=3, temperature=0)).json()
    assert choice["text"] == prompt + plain["choices"][0]["text"]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for position in range(1, len(ids)):
        entry = reference.prompt_logprobs[position]
        assert logprobs["tokens"][position] == entry[ids[position]].decoded_token
        assert logprobs["token_logprobs"][position] == pytest.approx(entry[ids[position]].logprob, abs=1e-5)
        assert logprobs["top_logprobs"][position] == pytest.approx(
            {lp.decoded_token: lp.logprob for lp in entry.values()}, abs=1e-5)
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs["tokens"]))
    # Streamed: the first chunk carries the prompt, and the whole adds up to the same.
    with http.stream("POST", "/v1/completions", json={**_body(prompt=prompt, echo=True, logprobs=2, max_tokens=3,
                                                               temperature=0), "stream": True}) as response:
        events = sse_events(response.iter_lines())[:-1]
    assert events[0]["choices"][0]["text"].startswith(prompt)
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
    assert sum((e["choices"][0]["logprobs"]["token_logprobs"] for e in events), []) == logprobs["token_logprobs"]


def test_echo_of_token_ids_decodes_them(http, llm):
    ids = TOKEN_PROMPTS[0]
    body = http.post("/v1/completions", json=_body(prompt=ids, echo=True, max_tokens=2, temperature=0)).json()
    assert body["choices"][0]["text"].startswith(llm.tokenizer.decode(ids, skip_special_tokens=False))


def test_a_chat_echo_starts_each_reply_with_the_assistants_final_message(http):
    opened = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    continued = _body(messages=opened, add_generation_prompt=False, continue_final_message=True, temperature=0, n=2)
    plain = http.post("/v1/chat/completions", json=continued).json()
    echoed = http.post("/v1/chat/completions", json={**continued, "echo": True}).json()
    assert [c["message"]["content"] for c in echoed["choices"]] == [
        "The colour is" + c["message"]["content"] for c in plain["choices"]]
    assert echoed["usage"] == plain["usage"]
    with http.stream("POST", "/v1/chat/completions", json={**continued, "echo": True, "stream": True}) as response:
        events = sse_events(response.iter_lines())[:-1]
    streamed = ["", ""]
    for event in events:
        for choice in event["choices"]:
            streamed[choice["index"]] += choice["delta"].get("content") or ""
    assert streamed == [c["message"]["content"] for c in echoed["choices"]]
    # A final message of the user's is no part of the reply.
    asked = _body(messages=opened[:1], echo=True, temperature=0)
    assert (http.post("/v1/chat/completions", json=asked).json()["choices"][0]["message"]["content"]
            == http.post("/v1/chat/completions", json={**asked, "echo": False}).json()["choices"][0]["message"]["content"])


def test_penalties_reach_the_engine(http, llm):
    prompt = TOKEN_PROMPTS[0] * 3
    fields = dict(repetition_penalty=1.6, frequency_penalty=0.8, presence_penalty=0.5, temperature=0)
    served = http.post("/v1/completions", json=_body(prompt=prompt, max_tokens=16, **fields)).json()
    expected = llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True, **fields))[0].outputs[0]
    plain = llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True, temperature=0))[0].outputs[0]
    assert served["choices"][0]["text"] == expected.text != plain.text


def test_allowed_token_ids_and_bad_words_reach_the_engine(http, llm):
    prompt = "A cache keeps"
    greedy = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
    plain = llm.generate([prompt], greedy)[0].outputs[0]
    allowed = [40, 41, 42]
    served = http.post("/v1/completions", json=_body(prompt=prompt, allowed_token_ids=allowed, temperature=0)).json()
    expected = llm.generate([prompt], dataclasses.replace(greedy, allowed_token_ids=allowed))[0].outputs[0]
    assert set(expected.token_ids) <= set(allowed)
    assert served["choices"][0]["text"] == expected.text != plain.text
    # A word that is one token, the first greedy decoding picks: banned, it never comes.
    first = plain.token_ids[0]
    word = llm.tokenizer.decode([first])
    assert [first] in bad_words_token_ids([word], lambda text: llm.tokenizer.encode(text, add_special_tokens=False).ids)
    served = http.post("/v1/completions", json=_body(prompt=prompt, temperature=0, bad_words=[word], logprobs=0)).json()
    assert served["choices"][0]["text"] != plain.text
    assert word not in served["choices"][0]["logprobs"]["tokens"]


@pytest.mark.parametrize("fields, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"100000": 5}}, "logit_bias"),
    ({"logit_bias": {"5": -101}}, "logit_bias"),
    ({"allowed_token_ids": [1, 100000]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"suffix": "x"}, "suffix"),
    ({"best_of": 3}, None),
    ({"min_tokens": 9}, "min_tokens"),
    ({"seed": -1}, "seed"),
    # Choice 1 would sample with seed 2**63, past what the engine takes.
    ({"seed": 2**63 - 1, "n": 2}, "seed"),
])
def test_out_of_range_fields_are_400s_naming_the_field(http, fields, param):
    error = assert_openai_error(http.post("/v1/completions", json=_body(prompt="x", **fields)), 400, param=param)
    assert next(iter(fields)) in error["message"]


def test_models_by_id(http):
    card = http.get("/v1/models/tiny")
    assert card.status_code == 200
    assert card.json() == http.get("/v1/models").json()["data"][0]
    error = assert_openai_error(http.get("/v1/models/other"), 404, code="model_not_found", param="model")
    assert "other" in error["message"]


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
])
def test_a_text_model_refuses_media_parts_saying_so(http, part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    error = assert_openai_error(http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages}),
                                400, param="messages")
    assert "this model takes text only" in error["message"] and part["type"] in error["message"]
