"""The OpenAI routes end to end: a real `kvpilot serve` process, real HTTP (httpx and the openai package)."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.tiny_model import BOS, IM_END, IM_START

from server_harness import HTTP_TIMEOUT_S, sse_events, sum_samples

PROMPTS = ["The quick brown fox", "To bake a simple loaf of bread", "A cache keeps", "In 1969"]
MAX_TOKENS = 24
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about trains."}]


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    """The offline engine's greedy outputs (with logprobs) for PROMPTS: what HTTP must reproduce."""
    llm = LLM(str(tiny_llama_dir))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    return llm, dict(zip(PROMPTS, llm.generate(PROMPTS, params)))


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S) as client:
        yield client


def _greedy(**fields) -> dict:
    return {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **fields}


def _stream(http: httpx.Client, path: str, body: dict) -> list:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_events(response.iter_lines())


def test_completion_text_equals_the_offline_engine(http, offline):
    _, expected = offline
    for prompt in PROMPTS:
        reference = expected[prompt]
        body = http.post("/v1/completions", json=_greedy(prompt=prompt)).json()
        assert body["object"] == "text_completion" and body["model"] == "tiny"
        assert body["id"].startswith("cmpl-")
        [choice] = body["choices"]
        assert choice["text"] == reference.outputs[0].text
        assert choice["finish_reason"] == "length" and choice["logprobs"] is None
        assert body["usage"] == {"prompt_tokens": len(reference.prompt_token_ids), "completion_tokens": MAX_TOKENS,
                                 "total_tokens": len(reference.prompt_token_ids) + MAX_TOKENS}


def test_streamed_completion_adds_up_to_the_same_text_and_usage(http, offline):
    _, expected = offline
    prompt = PROMPTS[1]
    events = _stream(http, "/v1/completions", _greedy(prompt=prompt, stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk, _ = events
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected[prompt].outputs[0].text
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == MAX_TOKENS
    assert usage_chunk["usage"]["prompt_tokens"] == len(expected[prompt].prompt_token_ids)


def test_stream_without_include_usage_has_no_usage_chunk(http):
    events = _stream(http, "/v1/completions", _greedy(prompt=PROMPTS[0], max_tokens=3))
    assert events[-1] == "[DONE]"
    assert all(event["choices"] and event.get("usage") is None for event in events[:-1])


def test_prompt_as_token_ids(http, offline):
    _, expected = offline
    reference = expected[PROMPTS[2]]
    body = http.post("/v1/completions", json=_greedy(prompt=reference.prompt_token_ids)).json()
    assert body["choices"][0]["text"] == reference.outputs[0].text


def test_chat_renders_the_template_and_equals_the_offline_engine(http, offline, tiny_llama_dir):
    llm, _ = offline
    rendered = BOS + "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in MESSAGES)
    rendered += f"{IM_START}assistant\n"
    tokenizer = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    expected_ids = tokenizer.encode(rendered, add_special_tokens=False).ids
    tokenized = http.post("/tokenize", json={"model": "tiny", "messages": MESSAGES}).json()
    assert tokenized["tokens"] == expected_ids and tokenized["count"] == len(expected_ids)

    [reference] = llm.generate([expected_ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    body = http.post("/v1/chat/completions", json=_greedy(messages=MESSAGES)).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": reference.outputs[0].text}
    assert choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(expected_ids)

    events = _stream(http, "/v1/chat/completions", _greedy(messages=MESSAGES))
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1])
    assert streamed == reference.outputs[0].text
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1] == "[DONE]"


def test_chat_max_tokens_defaults_to_the_rest_of_the_context(http):
    body = http.post("/v1/chat/completions", json={
        "messages": MESSAGES, "temperature": 0, "ignore_eos": True, "max_completion_tokens": 5,
    }).json()
    assert body["usage"]["completion_tokens"] == 5
    # Without a limit, an ignore_eos chat runs to max_model_len.
    max_model_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    body = http.post("/v1/chat/completions", json={"messages": MESSAGES, "temperature": 0, "ignore_eos": True}).json()
    assert body["usage"]["total_tokens"] == max_model_len
    assert body["choices"][0]["finish_reason"] == "length"


def test_n_2_gives_two_choices_and_sums_usage(http):
    body = http.post("/v1/completions", json={
        "prompt": PROMPTS[0], "n": 2, "max_tokens": 6, "ignore_eos": True, "seed": 7,
    }).json()
    assert sorted(c["index"] for c in body["choices"]) == [0, 1]
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 12

    events = _stream(http, "/v1/chat/completions", {
        "messages": MESSAGES, "n": 2, "max_tokens": 6, "ignore_eos": True, "seed": 7,
        "stream_options": {"include_usage": True},
    })
    # Each choice opens with its role and closes with its finish reason.
    opening = [e["choices"][0] for e in events[:2]]
    assert sorted(c["index"] for c in opening) == [0, 1]
    assert all(c["delta"]["role"] == "assistant" for c in opening)
    finished = [e["choices"][0]["index"] for e in events[:-2] if e["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]
    assert events[-2]["usage"]["completion_tokens"] == 12 and events[-1] == "[DONE]"


def _stop_string(text: str) -> str:
    """A two-letter stop string that occurs in the text after its first few characters."""
    for start in range(3, len(text) - 1):
        if text[start:start + 2].isalnum():
            return text[start:start + 2]
    pytest.skip(f"no alphanumeric pair in {text!r}")


def test_stop_string_ends_the_text_before_it(http, offline):
    _, expected = offline
    full = expected[PROMPTS[1]].outputs[0].text
    stop = _stop_string(full)
    cut = full[: full.index(stop)]
    body = http.post("/v1/completions", json=_greedy(prompt=PROMPTS[1], stop=[stop, "never-generated"])).json()
    [choice] = body["choices"]
    assert choice["text"] == cut
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop

    events = _stream(http, "/v1/completions", _greedy(prompt=PROMPTS[1], stop=stop))
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == cut
    assert events[-2]["choices"][0]["finish_reason"] == "stop"

    body = http.post("/v1/completions", json=_greedy(prompt=PROMPTS[1], stop=stop,
                                                     include_stop_str_in_output=True)).json()
    assert body["choices"][0]["text"] == cut + stop


def test_a_text_ending_inside_a_character_is_the_same_offline_and_served(http, offline):
    # Byte-level tokens: a completion can stop after the first bytes of a multi-byte character,
    # where a one-shot decode ends in U+FFFD. Offline and served text share one OutputProcessor,
    # which holds such bytes back, so both say the same and never take back what they said.
    llm, _ = offline
    prompt = PROMPTS[0]
    greedy = dict(temperature=0, ignore_eos=True)
    longer = llm.generate(prompt, SamplingParams(max_tokens=40, **greedy))[0].outputs[0]
    ends = [k for k in range(1, 41) if llm.tokenizer.decode(longer.token_ids[:k]).endswith("\ufffd")]
    assert ends, "the greedy tokens never end inside a character: the case is not exercised"
    for max_tokens in ends[:3]:
        offline_text = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, **greedy))[0].outputs[0].text
        body = http.post("/v1/completions", json=_greedy(prompt=prompt, max_tokens=max_tokens)).json()
        events = _stream(http, "/v1/completions", _greedy(prompt=prompt, max_tokens=max_tokens))
        assert body["choices"][0]["text"] == offline_text
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == offline_text
        assert longer.text.startswith(offline_text)


def test_stop_token_ids_end_the_choice(http, offline):
    _, expected = offline
    token_ids = expected[PROMPTS[0]].outputs[0].token_ids
    body = http.post("/v1/completions", json=_greedy(prompt=PROMPTS[0], stop_token_ids=[token_ids[3]])).json()
    [choice] = body["choices"]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == token_ids[3]
    assert body["usage"]["completion_tokens"] == token_ids.index(token_ids[3]) + 1


def test_logit_bias_steers_the_choice(http, offline, tiny_llama_dir):
    _, expected = offline
    greedy = expected[PROMPTS[0]].outputs[0]
    tokenizer = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    favoured = next(t for t in tokenizer.encode(" river stone market", add_special_tokens=False).ids
                    if t not in greedy.token_ids)
    body = _greedy(prompt=PROMPTS[0], max_tokens=4)
    biased = http.post("/v1/completions", json={**body, "logit_bias": {str(favoured): 100}}).json()
    assert biased["choices"][0]["text"] == tokenizer.decode([favoured] * 4)
    # Banning the greedy first token makes the choice start otherwise.
    banned = http.post("/v1/completions", json={**body, "logit_bias": {str(greedy.token_ids[0]): -100},
                                                "logprobs": 0}).json()
    first = banned["choices"][0]["logprobs"]["tokens"][0]
    assert first != tokenizer.decode([greedy.token_ids[0]])


def test_completion_logprobs_match_the_offline_engine(http, offline):
    _, expected = offline
    reference = expected[PROMPTS[0]].outputs[0]
    body = http.post("/v1/completions", json=_greedy(prompt=PROMPTS[0], logprobs=2)).json()
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == MAX_TOKENS
    for position, (token_id, logprob) in enumerate(zip(reference.token_ids, logprobs["token_logprobs"])):
        assert logprob == pytest.approx(reference.logprobs[position][token_id].logprob, abs=1e-4)
        # Greedy: the sampled token is the most likely one, listed with the top 2.
        top = logprobs["top_logprobs"][position]
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(logprob, abs=1e-6)
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0
    assert all(b - a == len(token) for a, b, token in zip(offsets, offsets[1:], logprobs["tokens"]))

    events = _stream(http, "/v1/completions", _greedy(prompt=PROMPTS[0], logprobs=2))
    streamed = [lp for e in events[:-1] for lp in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(logprobs["token_logprobs"], abs=1e-4)


def test_prompt_logprobs_match_the_offline_engine(http, offline):
    llm, _ = offline
    [reference] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))
    body = http.post("/v1/completions", json=_greedy(prompt=PROMPTS[0], max_tokens=2, prompt_logprobs=2)).json()
    served = body["choices"][0]["prompt_logprobs"]
    assert len(served) == len(reference.prompt_token_ids) and served[0] is None
    for position in range(1, len(served)):
        expected = reference.prompt_logprobs[position]
        assert set(served[position]) == {str(token) for token in expected}
        for token, entry in expected.items():
            got = served[position][str(token)]
            assert got["logprob"] == pytest.approx(entry.logprob, abs=1e-4) and got["rank"] == entry.rank
    # Streamed, they come once, on the first chunk.
    events = _stream(http, "/v1/completions", _greedy(prompt=PROMPTS[0], max_tokens=2, prompt_logprobs=2))
    firsts = [e["choices"][0]["prompt_logprobs"] for e in events[:-1]]
    assert firsts[0] == served and all(first is None for first in firsts[1:])


def test_chat_logprobs_list_the_top_alternatives(http):
    body = http.post("/v1/chat/completions", json=_greedy(messages=MESSAGES, logprobs=True, top_logprobs=3)).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == MAX_TOKENS
    text = ""
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 3
        values = [alt["logprob"] for alt in entry["top_logprobs"]]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert entry["logprob"] == pytest.approx(values[0], abs=1e-6)  # greedy picks the top one
        text += entry["token"]
    # Without top_logprobs, only the sampled tokens' logprobs come back.
    body = http.post("/v1/chat/completions", json=_greedy(messages=MESSAGES, logprobs=True, max_tokens=2)).json()
    assert [e["top_logprobs"] for e in body["choices"][0]["logprobs"]["content"]] == [[], []]


def test_cache_salt_separates_prefix_caches(server, http):
    prompt = "Salted: " + " ".join(f"word{i}" for i in range(40))

    def hits_after(**fields) -> float:
        before = server.metric("vllm:prefix_cache_hits_total")
        assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, **fields}).status_code == 200
        return server.metric("vllm:prefix_cache_hits_total") - before

    assert hits_after(cache_salt="salt-a") == 0
    assert hits_after(cache_salt="salt-b") == 0
    assert hits_after() == 0
    assert hits_after(cache_salt="salt-a") > 0


def test_the_openai_package_works_against_the_server(server, offline):
    _, expected = offline
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=HTTP_TIMEOUT_S, max_retries=0)
    [model] = client.models.list().data
    assert model.id == "tiny"

    extra = {"ignore_eos": True}
    completion = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body=extra)
    assert completion.choices[0].text == expected[PROMPTS[3]].outputs[0].text
    assert completion.usage.completion_tokens == MAX_TOKENS

    stream = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True}, extra_body=extra)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == completion.choices[0].text
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS

    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body=extra)
    assert chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].logprobs.content) == 8 and chat.usage.completion_tokens == 8

    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, extra_body=extra)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8

    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert raised.value.code == "model_not_found"


def test_utility_routes(http):
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"]) for m in models["data"]] == [("tiny", "model")]
    assert models["data"][0]["max_model_len"] == 2048

    assert http.get("/health").json() == {"status": "ok", "scheduling_policy": "fcfs"}
    assert http.get("/version").json()["version"]

    tokens = http.post("/tokenize", json={"prompt": "To bake a loaf"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 2048
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": BOS + "To bake a loaf"}
    no_bos = http.post("/tokenize", json={"prompt": "To bake a loaf", "add_special_tokens": False}).json()
    assert no_bos["tokens"] == tokens["tokens"][1:]


def test_metrics_use_the_vllm_names(server, http):
    http.post("/v1/completions", json=_greedy(prompt=PROMPTS[0], max_tokens=2))
    samples = server.metrics()
    names = {name for name, _ in samples}
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:cache_config_info", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_count", "kvpilot:scheduling_policy_info"]:
        assert name in names, name
    [(labels, value)] = [(dict(l), v) for (n, l), v in samples.items() if n == "vllm:cache_config_info"]
    assert value == 1 and labels["block_size"] == "16" and int(labels["num_gpu_blocks"]) > 1
    assert samples[("kvpilot:scheduling_policy_info", (("policy", "fcfs"),))] == 1
    assert samples[("kvpilot:scheduling_policy_info", (("policy", "priority"),))] == 0
    raw = http.get("/metrics").text
    assert 'model_name="tiny"' in raw
    assert not math.isnan(samples[("vllm:kv_cache_usage_perc", ())])


def test_request_success_counts_every_finished_request(server, http):
    before = server.metrics()
    for prompt in PROMPTS:
        http.post("/v1/completions", json=_greedy(prompt=prompt, max_tokens=3))
    http.post("/v1/completions", json=_greedy(prompt=PROMPTS[0], max_tokens=3, n=2))
    after = server.metrics()

    def delta(name, **labels):
        return sum_samples(after, name, **labels) - sum_samples(before, name, **labels)

    assert delta("vllm:request_success_total") == 6
    assert delta("vllm:request_success_total", finished_reason="length") == 6
    assert delta("vllm:generation_tokens_total") == 18
    assert delta("vllm:e2e_request_latency_seconds_count") == 6
    assert delta("vllm:inter_token_latency_seconds_count") == 12
