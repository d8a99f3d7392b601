"""Chat templates from tokenizer_config.json, rendered in a sandbox (no server needed)."""

from __future__ import annotations

import json

import pytest

from kvpilot.runtime.server.chat_template import ChatTemplate, ChatTemplateError
from kvpilot.runtime.tiny_model import BOS, IM_END, IM_START

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b>!"}]


@pytest.fixture(scope="module")
def tiny_template(tiny_llama_dir) -> ChatTemplate:
    return ChatTemplate(json.loads((tiny_llama_dir / "tokenizer_config.json").read_text()))


def test_the_tiny_models_template_renders_chatml_with_bos(tiny_template):
    turns = f"{IM_START}system\nBe brief.{IM_END}\n{IM_START}user\nHi <b>!{IM_END}\n"
    assert tiny_template.render(MESSAGES) == BOS + turns + f"{IM_START}assistant\n"
    assert tiny_template.render(MESSAGES, add_generation_prompt=False) == BOS + turns


def test_continue_final_message_leaves_the_last_turn_open(tiny_template):
    messages = [*MESSAGES, {"role": "assistant", "content": "Hello, I"}]
    prompt = tiny_template.render(messages, add_generation_prompt=False, continue_final_message=True)
    assert prompt.endswith(f"{IM_START}assistant\nHello, I")


def _template(source, **config) -> ChatTemplate:
    return ChatTemplate({"chat_template": source, **config})


def test_special_tokens_and_helpers_are_available():
    template = _template("{{ bos_token }}{{ messages | tojson }}{{ eos_token }}",
                         bos_token={"content": "<s>", "lstrip": False}, eos_token="</s>")
    assert template.render([{"role": "user", "content": "<&>"}]) == '<s>[{"role": "user", "content": "<&>"}]</s>'


def test_a_named_default_template_is_used():
    template = ChatTemplate({"chat_template": [{"name": "tool_use", "template": "tools"},
                                              {"name": "default", "template": "default"}]})
    assert template.render(MESSAGES) == "default"


@pytest.mark.parametrize("config, complaint", [
    ({}, "no chat template"),
    ({"chat_template": "{% for %}"}, "does not compile"),
    ({"chat_template": "{{ raise_exception('roles must alternate') }}"}, "roles must alternate"),
    ({"chat_template": "{{ messages.__class__.__mro__ }}"}, "failed"),
    ({"chat_template": "{{ ''.__class__.__subclasses__() }}"}, "failed"),
    ({"chat_template": "{% set _ = messages.append(1) %}"}, "failed"),
    ({"chat_template": "{{ messages[0]['content'] + 1 }}"}, "failed"),
])
def test_template_failures_are_request_errors(config, complaint):
    with pytest.raises(ChatTemplateError, match=complaint):
        ChatTemplate(config).render(MESSAGES)
