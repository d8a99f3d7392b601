"""Chat templates from tokenizer_config.json, rendered in a sandbox (no server needed)."""

from __future__ import annotations

import json

import pytest

from kvpilot.runtime.server.chat_template import ChatTemplate, ChatTemplateError
from kvpilot.runtime.server.protocol import ChatCompletionRequest
from kvpilot.runtime.tiny_model import BOS, IM_END, IM_START

from tool_conversations import CONVERSATION, HERMES_STYLE_TEMPLATE, HF_CONVERSATION, TOOLS

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


# -- tools and tool calls in the history ------------------------------------------------------------

def _rendered_by_us(template: ChatTemplate, tools=TOOLS, **kwargs) -> str:
    # Through the request models, as the server renders a request.
    request = ChatCompletionRequest.model_validate({"messages": CONVERSATION, "tools": tools, "tool_choice": "none"})
    return template.render([m.as_template_input() for m in request.messages],
                           tools=[t.as_template_input() for t in request.tools], **kwargs)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tools_and_tool_results_render_as_transformers_renders_them(hf_tokenizer, add_generation_prompt):
    ours = _rendered_by_us(_template(HERMES_STYLE_TEMPLATE), add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(HF_CONVERSATION, tools=TOOLS, chat_template=HERMES_STYLE_TEMPLATE,
                                              tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    # What the template was given, visibly: the tools, the calls with their arguments as objects, the results.
    assert json.dumps(TOOLS[0]) in ours
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in ours
    assert '<tool_response id="call_2">\n14:05\n</tool_response>' in ours


def test_a_tool_use_template_is_picked_when_there_are_tools(hf_tokenizer):
    named = [{"name": "default", "template": "{{ messages | length }} turns"},
             {"name": "tool_use", "template": HERMES_STYLE_TEMPLATE}]
    ours = ChatTemplate({"chat_template": named})
    hf_tokenizer.chat_template = {entry["name"]: entry["template"] for entry in named}
    assert _rendered_by_us(ours) == hf_tokenizer.apply_chat_template(HF_CONVERSATION, tools=TOOLS, tokenize=False,
                                                                    add_generation_prompt=True)
    assert ours.render(MESSAGES) == "2 turns"


def test_smollm2s_template_renders_a_tool_conversation_as_transformers_does(smollm2_gguf, hf_tokenizer):
    from kvpilot.runtime.models.tokenizer_loader import load_tokenizer

    _, config = load_tokenizer(str(smollm2_gguf))
    # SmolLM2's template knows no tools: it writes each turn's content, tool results included.
    ours = _rendered_by_us(ChatTemplate(config))
    theirs = hf_tokenizer.apply_chat_template(HF_CONVERSATION, tools=TOOLS, chat_template=config["chat_template"],
                                              tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert "<|im_start|>tool\n18 C, sunny<|im_end|>" in ours


def test_tojson_takes_transformers_options():
    template = _template("{{ messages[0] | tojson(indent=1, sort_keys=True, separators=(',', ':')) }}")
    assert template.render([{"role": "user", "content": "é"}]) == '{\n "content":"é",\n "role":"user"\n}'
