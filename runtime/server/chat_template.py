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
        source = _default_template(tokenizer_config.get("chat_template"))
        # The same environment options transformers uses, so templates render as they do there.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = None
        self._unusable = "this model has no chat template (tokenizer_config.json has no chat_template)"
        if source is not None:
            try:
                self._template = env.from_string(source)
            except jinja2.TemplateSyntaxError as err:
                self._unusable = f"the model's chat template does not compile: {err}"
        self._special_tokens = {
            name: _token_text(tokenizer_config.get(name))
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               continue_final_message: bool = False) -> str:
        if self._template is None:
            raise ChatTemplateError(self._unusable)
        try:
            prompt = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                           **self._special_tokens)
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


def _default_template(template) -> str | None:
    # tokenizer_config.json holds one template, or a list of named ones of which "default" is used.
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        return named.get("default")
    return template


def _token_text(token) -> str:
    # Special tokens are written either as a string or as an AddedToken dict.
    if isinstance(token, dict):
        return token.get("content", "")
    return token or ""


def _tojson(value, indent=None) -> str:
    # jinja2's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise_exception(message: str):
    raise ChatTemplateError(message)
