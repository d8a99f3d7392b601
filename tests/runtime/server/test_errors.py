"""Every error a client can cause, over real HTTP: its status code and the OpenAI error shape."""

from __future__ import annotations

import socket

import httpx
import pytest

from server_harness import HTTP_TIMEOUT_S, assert_openai_error, parse_http_response


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S) as client:
        yield client


def test_unknown_route_is_404(http):
    assert_openai_error(http.get("/v1/nothing-here"), 404, code="not_found")
    assert_openai_error(http.post("/nothing-here", json={}), 404, code="not_found")


def test_wrong_method_is_405(http):
    assert_openai_error(http.get("/v1/completions"), 405)


def test_unknown_model_is_404(http):
    for path, body in [("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/tokenize", {"prompt": "x"})]:
        error = assert_openai_error(http.post(path, json={"model": "gpt-17", **body}), 404,
                                    code="model_not_found", param="model")
        assert "gpt-17" in error["message"]


def test_admin_without_a_configured_token_is_404(http):
    assert_openai_error(http.post("/admin/scheduling", json={"policy": "priority"},
                                  headers={"Authorization": "Bearer anything"}), 404)


@pytest.mark.parametrize("request_bytes", [
    b"GARBAGE\r\n\r\n",
    b"GET /health HTTP/1.1\r\n\r\n",  # HTTP/1.1 without Host
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
])
def test_what_is_not_http_is_400_in_the_openai_shape_too(server, request_bytes):
    url = httpx.URL(server.base_url)
    with socket.create_connection((url.host, url.port), timeout=HTTP_TIMEOUT_S) as sock:
        sock.sendall(request_bytes)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status, body = parse_http_response(answer)
    assert status == 400 and set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and "HTTP" in body["error"]["message"]


def test_malformed_json_is_400(http):
    response = http.post("/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    error = assert_openai_error(response, 400)
    assert "JSON" in error["message"]
    assert_openai_error(http.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"}),
                        400)
    assert_openai_error(http.post("/v1/completions", content=b"\xff\xfe", headers={"content-type": "application/json"}),
                        400)


@pytest.mark.parametrize("content, complaint", [
    (b'{"prompt": "\xff\xfe"}', "the request body is not valid UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "the request body nests too deeply to parse"),
    (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", "the request body is not valid JSON: Exceeds the limit"),
])
def test_a_body_that_cannot_be_parsed_says_why(http, content, complaint):
    response = http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert complaint in assert_openai_error(response, 400)["message"]


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "x", "cache_salt": ""}, "cache_salt"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, None),
    ({"prompt": []}, "prompt"),
    ({"prompt": [["a"], "b"]}, "prompt"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "priority": "high"}, "priority"),
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "priority": -(2**64)}, "priority"),
    ({"prompt": "x", "top_k": 2**64}, "top_k"),
])
def test_invalid_completion_fields_are_400(http, body, param):
    error = assert_openai_error(http.post("/v1/completions", json=body), 400)
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize("body", [
    {"prompt": ""},
    {"prompt": []},
    {"prompt": [1, 2, 100000]},
    {"prompt": "x", "stop_token_ids": [100000]},
    {"prompt": "x", "min_tokens": 10, "max_tokens": 5},
])
def test_bad_values_the_engine_would_refuse_are_400(http, body):
    assert_openai_error(http.post("/v1/completions", json=body), 400)


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"content": "no role"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
    {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21, "logprobs": True},
    {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
])
def test_invalid_chat_fields_are_400(http, body):
    assert_openai_error(http.post("/v1/chat/completions", json=body), 400)


def test_prompt_plus_max_tokens_over_max_model_len_is_400_naming_both_numbers(http):
    prompt_tokens = http.post("/tokenize", json={"prompt": "To bake a loaf"}).json()["count"]
    error = assert_openai_error(http.post("/v1/completions", json={"prompt": "To bake a loaf", "max_tokens": 2040}),
                                400, param="max_tokens")
    assert "2048" in error["message"] and str(prompt_tokens + 2040) in error["message"]
    # A prompt that alone fills the context.
    error = assert_openai_error(http.post("/v1/completions", json={"prompt": [5] * 2048, "max_tokens": None}), 400)
    assert "2048" in error["message"]
    error = assert_openai_error(http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000}), 400)
    assert "2048" in error["message"]


def test_tokenize_needs_exactly_one_of_prompt_and_messages(http):
    assert_openai_error(http.post("/tokenize", json={}), 400)
    assert_openai_error(http.post("/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "x"}]}),
                        400)
    assert_openai_error(http.post("/detokenize", json={"tokens": [1, 10**9]}), 400, param="tokens")
