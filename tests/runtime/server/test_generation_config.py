"""--generation-config: the model's recommended sampling replaces OpenAI's defaults, never a field
the client sets."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvpilot.runtime import cli
from kvpilot.runtime.models.generation_config import generation_defaults
from kvpilot.runtime.server.limits import ServerLimits
from kvpilot.runtime.server.protocol import CompletionRequest
from kvpilot.runtime.server.serving import Serving


def _model(folder, **config):
    folder.mkdir(exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, "max_new_tokens": 9, **config}))
    return str(folder)


def test_auto_reads_the_sampling_keys_beside_the_model(tmp_path):
    model = _model(tmp_path / "m", temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1)
    expected = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
    assert generation_defaults(model) == expected
    assert generation_defaults(model, "vllm") == {}
    assert generation_defaults(str(tmp_path / "m" / "model.gguf")) == expected
    assert generation_defaults(str(tmp_path / "none")) == {}


def test_a_path_reads_that_folders_file_and_a_bad_one_is_a_usage_error(tmp_path, capsys, tiny_llama_dir):
    other = _model(tmp_path / "other", min_p=0.05)
    assert generation_defaults(str(tiny_llama_dir), other) == {"min_p": 0.05}
    with pytest.raises(SystemExit) as raised:
        cli.main(["serve", str(tiny_llama_dir), "--generation-config", str(tmp_path / "missing")])
    assert raised.value.code == 2
    assert "no generation_config.json in" in capsys.readouterr().err


def test_defaults_fill_only_the_fields_a_request_leaves_out():
    engine = SimpleNamespace(max_model_len=64, validate=lambda ids, params, resume_token_ids: None)
    serving = Serving(engine, "m", None, ServerLimits(), tokenizers=None,
                      sampling_defaults={"temperature": 0.6, "top_k": 20})
    body = CompletionRequest(prompt="x", temperature=0.0)
    request = serving.engine_request(body, [1, 2], prompt_param="prompt", max_tokens=4, logprobs=None,
                                     tenant=None, request_id="r")
    assert (request.params.temperature, request.params.top_k, request.params.top_p) == (0.0, 20, 1.0)
    plain = Serving(engine, "m", None, ServerLimits(), tokenizers=None).engine_request(CompletionRequest(prompt="x"), [1], prompt_param="prompt",
                                                      max_tokens=4, logprobs=None, tenant=None, request_id="r")
    assert (plain.params.temperature, plain.params.top_k) == (1.0, 0)
