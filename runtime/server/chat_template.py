"""Render chat messages into a prompt with the model's own template from tokenizer_config.json.

Templates come with checkpoints, so they are untrusted code: they run in jinja2's immutable
sandbox, with the few helpers Hugging Face templates expect. The rendered prompt carries its own
special tokens (BOS included), so it is tokenized with add_special_tokens=False.
"""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template is missing or rejects the messages; the message says why."""


class ChatTemplate:
    def __init__(self, tokenizer_config: dict) -> None:
        # The same environment options transformers uses, so templates render as they do there.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._unusable = "this model has no chat template (tokenizer_config.json has no chat_template)"
        self._template = self._tool_template = None
        sources = _templates(tokenizer_config.get("chat_template"))
        try:
            if sources.get("default") is not None:
                self._template = env.from_string(sources["default"])
            if sources.get("tool_use") is not None:
                self._tool_template = env.from_string(sources["tool_use"])
        except jinja2.TemplateSyntaxError as err:
            self._template = self._tool_template = None
            self._unusable = f"the model's chat template does not compile: {err}"
        self._special_tokens = {
            name: _token_text(tokenizer_config.get(name))
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: list[dict] | None = None) -> str:
        # As transformers picks: a checkpoint's "tool_use" template when the request has tools.
        template = self._tool_template if tools is not None and self._tool_template is not None else self._template
        if template is None:
            raise ChatTemplateError(self._unusable)
        try:
            prompt = template.render(messages=messages, tools=tools, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self._special_tokens)
        except ChatTemplateError:
            raise
        except Exception as err:
            # The template is code from the checkpoint running on client input: whatever it
            # raises (a sandbox violation, a TypeError on an odd message) is a rejected request.
            raise ChatTemplateError(f"the chat template failed on these messages: {err}") from err
        if continue_final_message:
            # Cut whatever the template adds after the last message (its end-of-turn), so the
            # model continues that message instead of starting a new one.
            final = messages[-1]["content"]
            end = prompt.rfind(final)
            if not final or end < 0:
                raise ChatTemplateError("continue_final_message: the final message is empty or not in the prompt")
            prompt = prompt[: end + len(final)]
        return prompt


def _templates(template) -> dict[str, str]:
    # tokenizer_config.json holds one template, or a list of named ones ("default", "tool_use", ...).
    if isinstance(template, list):
        return {entry.get("name"): entry.get("template") for entry in template}
    return {"default": template}


def _token_text(token) -> str:
    # Special tokens are written either as a string or as an AddedToken dict.
    if isinstance(token, dict):
        return token.get("content", "")
    return token or ""


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja2's own tojson escapes HTML characters, which would change the prompt; these are the
    # options transformers' filter takes.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise ChatTemplateError(message)
