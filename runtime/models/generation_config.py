"""Sampling defaults a model's creator ships in generation_config.json, applied as vLLM applies them.

`--generation-config auto` (the default) reads the file beside the model, `vllm` ignores it, and a
folder path reads that folder's file. A request field the client sets always wins; the defaults
only replace the OpenAI defaults of the fields it leaves out.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvpilot.runtime.models.gguf_checkpoint import is_gguf

# The generation_config.json keys the engine's sampler implements, under the request's names.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(model: str, setting: str = "auto") -> dict:
    """{request field: default} from the model's generation config; ValueError for a bad PATH."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        # A GGUF file carries no generation config; one may sit in the folder beside it.
        folder = Path(model).parent if is_gguf(model) else Path(model)
    else:
        folder = Path(setting)
        if not (folder / "generation_config.json").is_file():
            raise ValueError(f"generation_config: no generation_config.json in {setting} "
                             "(give auto, vllm, or a folder that holds one)")
    file = folder / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"generation_config: {file} is not readable JSON: {err}") from None
    return {key: raw[key] for key in SAMPLING_KEYS if raw.get(key) is not None}
