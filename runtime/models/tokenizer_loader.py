"""The tokenizer and its config (chat template, special tokens) for a model, HF folder or GGUF file."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from kvpilot.runtime.models.gguf_checkpoint import is_gguf, open_gguf


def load_tokenizer(model: str, tokenizer: str | None = None) -> tuple[Tokenizer, dict]:
    """From `tokenizer` when given (vLLM's --tokenizer), else from the model itself.

    Returns the tokenizer and a dict shaped like tokenizer_config.json (empty when the folder has none).
    """
    source = tokenizer or model
    if is_gguf(source):
        from kvpilot.runtime.models.gguf_tokenizer import gguf_tokenizer

        return gguf_tokenizer(open_gguf(source))
    folder = Path(source)
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"model: no tokenizer.json in {source}")
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    return Tokenizer.from_file(str(tokenizer_file)), config
