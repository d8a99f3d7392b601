"""LoRA adapters served: a request names its adapter as `model`; vLLM's load and unload routes
behind the admin token; bad adapters refused with a 400 naming them while the rest keeps serving;
the host cache's LRU eviction and reload on demand; tenants reaching only their own adapters; and
the adapters' metrics. One server for the module (each start costs an engine process)."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import aiohttp
import httpx
import pytest
import torch

from server_harness import ADMIN_TOKEN, HTTP_TIMEOUT_S, SERVER_API_KEY, assert_openai_error, start_server

peft = pytest.importorskip("peft")

ALPHA_KEY, BETA_KEY = "alpha-key", "beta-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
# Two blocks of 16 tokens and a bit: enough for prefix-cache hits.
PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir, tmp_path_factory, make_peft_adapter) -> dict:
    folder = tmp_path_factory.mktemp("lora-adapters")
    dirs = {name: make_peft_adapter(tiny_llama_dir, folder / name, seed=seed)
            for seed, name in enumerate(["shared", "alpha-lora", "beta-lora", "lru-a", "lru-b", "live"])}
    dirs["too-big"] = make_peft_adapter(tiny_llama_dir, folder / "too-big", r=16, lora_alpha=16)
    dirs["head"] = make_peft_adapter(tiny_llama_dir, folder / "head", target_modules=["q_proj", "lm_head"])
    dirs["corrupt"] = shutil.copytree(dirs["shared"], folder / "corrupt")
    weights = dirs["corrupt"] / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    dirs["missing"] = folder / "missing"
    dirs["too-long"] = folder / ("a" * 300)  # one name past the file system's 255 bytes
    return dirs


@pytest.fixture(scope="module")
def lora_server(tiny_llama_dir, adapter_dirs, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora-server")
    (folder / "admin-token").write_text(ADMIN_TOKEN)
    (folder / "tenants.json").write_text(json.dumps([
        {"name": "alpha", "apiKeys": [ALPHA_KEY], "adapters": ["alpha-lora"]},
        {"name": "beta", "apiKeys": [BETA_KEY], "adapters": ["beta-lora"]},
    ]))
    server = start_server(
        tiny_llama_dir, folder, "--served-model-name", "tiny", "--enable-lora", "--max-loras", "2",
        "--max-cpu-loras", "2", "--max-lora-rank", "8", "--block-size", "16",
        "--lora-modules", f"shared={adapter_dirs['shared']}",
        "--tenants-file", str(folder / "tenants.json"), "--api-key", SERVER_API_KEY,
        "--admin-token-file", str(folder / "admin-token"))
    for name in ("alpha-lora", "beta-lora"):
        assert load(server, name, adapter_dirs[name]).status_code == 200
    yield server
    server.stop()


def load(server, name, path, headers=ADMIN) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                      headers=headers, timeout=HTTP_TIMEOUT_S)


def unload(server, name, headers=ADMIN) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=headers,
                      timeout=HTTP_TIMEOUT_S)


def complete(server, model, key=ALPHA_KEY, prompt=PROMPT) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True}, timeout=HTTP_TIMEOUT_S)


def tokens(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def listed(server, key=None, headers=None) -> dict[str, dict]:
    response = httpx.get(f"{server.base_url}/v1/models", timeout=HTTP_TIMEOUT_S,
                         headers=headers or {"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return {card["id"]: card for card in response.json()["data"]}


def merged_greedy(base_dir, adapter_dir, prompt: list[int], new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir)
    model = model.merge_and_unload().eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0)
    return out[0, len(prompt):].tolist()


def loaded_adapters(server) -> set[str]:
    return {dict(labels)["lora_name"] for (name, labels), value in server.metrics().items()
            if name == "kvpilot:lora_adapter_loaded" and value == 1}


def test_a_request_names_its_adapter_as_the_model(lora_server, tiny_llama_dir, adapter_dirs):
    response = complete(lora_server, "alpha-lora")
    assert response.json()["model"] == "alpha-lora"
    assert tokens(response) == merged_greedy(tiny_llama_dir, adapter_dirs["alpha-lora"], PROMPT, 8)
    assert tokens(response) != tokens(complete(lora_server, "tiny"))
    chat = httpx.post(f"{lora_server.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {ALPHA_KEY}"},
                      json={"model": "shared", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                      timeout=HTTP_TIMEOUT_S)
    assert chat.status_code == 200 and chat.json()["model"] == "shared"


def test_models_lists_the_base_and_each_tenants_adapters_with_their_parent(lora_server, adapter_dirs):
    alpha = listed(lora_server, ALPHA_KEY)
    assert list(alpha) == ["tiny", "shared", "alpha-lora"]
    assert alpha["alpha-lora"]["parent"] == "tiny" and alpha["alpha-lora"]["root"] == str(adapter_dirs["alpha-lora"])
    assert alpha["tiny"]["parent"] is None
    assert list(listed(lora_server, BETA_KEY)) == ["tiny", "shared", "beta-lora"]
    # The server key has no tenant: only what no tenant owns. The admin token sees everything loaded.
    assert list(listed(lora_server, SERVER_API_KEY)) == ["tiny", "shared"]
    assert {"shared", "alpha-lora", "beta-lora"} <= set(listed(lora_server, headers=ADMIN))


def test_a_tenant_cannot_use_another_tenants_adapter_which_looks_like_none_at_all(lora_server):
    foreign = assert_openai_error(complete(lora_server, "alpha-lora", key=BETA_KEY), 404, "model_not_found", "model")
    unknown = assert_openai_error(complete(lora_server, "no-such-lora", key=BETA_KEY), 404, "model_not_found", "model")
    assert foreign["message"] == unknown["message"].replace("no-such-lora", "alpha-lora")
    assert httpx.get(f"{lora_server.base_url}/v1/models/alpha-lora", timeout=HTTP_TIMEOUT_S,
                     headers={"Authorization": f"Bearer {BETA_KEY}"}).status_code == 404
    assert tokens(complete(lora_server, "beta-lora", key=BETA_KEY))


def test_load_use_unload_and_use_again_is_a_404_without_a_restart(lora_server, adapter_dirs):
    assert_openai_error(load(lora_server, "live", adapter_dirs["live"], headers={}), 401, "invalid_admin_token")
    response = load(lora_server, "live", adapter_dirs["live"])
    assert response.status_code == 200 and "live" in response.text
    assert_openai_error(load(lora_server, "live", adapter_dirs["live"]), 400, param="lora_name")
    assert tokens(complete(lora_server, "live"))
    assert "live" in loaded_adapters(lora_server)
    assert unload(lora_server, "live").status_code == 200
    assert_openai_error(complete(lora_server, "live"), 404, "model_not_found")
    assert "live" not in loaded_adapters(lora_server)
    assert "live" not in listed(lora_server, headers=ADMIN)
    assert_openai_error(unload(lora_server, "live"), 404, "not_found")


@pytest.mark.parametrize("name, problem", [
    ("too-big", "rank 16 is above --max-lora-rank 8"),
    ("head", "lm_head.*adapts something other than"),
    ("corrupt", "not readable safetensors"),
    ("missing", "no adapter_config.json"),
    ("too-long", "its files cannot be read: File name too long"),
])
def test_a_bad_adapter_gets_a_400_naming_it_and_the_rest_keeps_serving(lora_server, adapter_dirs, name, problem):
    import re

    error = assert_openai_error(load(lora_server, name, adapter_dirs[name]), 400)
    assert re.search(f"'{name}'.*{problem}", error["message"]), error["message"]
    assert name not in listed(lora_server, headers=ADMIN)
    assert tokens(complete(lora_server, "alpha-lora"))


def test_loading_past_max_cpu_loras_evicts_the_least_recently_used_which_reloads_on_demand(lora_server, adapter_dirs):
    assert load(lora_server, "lru-a", adapter_dirs["lru-a"]).status_code == 200
    first = tokens(complete(lora_server, "lru-a"))
    assert load(lora_server, "lru-b", adapter_dirs["lru-b"]).status_code == 200
    assert loaded_adapters(lora_server) == {"lru-a", "lru-b"}
    # A third adapter in use: the least recently used (lru-a) leaves host memory.
    assert tokens(complete(lora_server, "shared"))
    assert loaded_adapters(lora_server) == {"lru-b", "shared"}
    # Still served: loaded again from its folder on its next request, with the same answer.
    assert tokens(complete(lora_server, "lru-a")) == first
    assert loaded_adapters(lora_server) == {"shared", "lru-a"}
    assert "lru-a" in listed(lora_server, headers=ADMIN)


def test_an_evicted_adapter_whose_folder_is_gone_fails_its_request_not_the_engine(lora_server, adapter_dirs,
                                                                                  tmp_path):
    doomed = shutil.copytree(adapter_dirs["live"], tmp_path / "doomed")
    assert load(lora_server, "doomed", doomed).status_code == 200
    for model in ("alpha-lora", "shared"):
        assert tokens(complete(lora_server, model))
    assert "doomed" not in loaded_adapters(lora_server)
    shutil.rmtree(doomed)
    error = assert_openai_error(complete(lora_server, "doomed"), 400)
    assert "'doomed'" in error["message"] and "no adapter_config.json" in error["message"]
    assert tokens(complete(lora_server, "alpha-lora"))
    assert unload(lora_server, "doomed").status_code == 200


def test_two_adapters_on_the_same_prompt_share_no_prefix_cache_blocks(lora_server):
    prompt = list(range(100, 140))
    tokens(complete(lora_server, "alpha-lora", prompt=prompt))
    hits = lora_server.metric("vllm:prefix_cache_hits_total")
    tokens(complete(lora_server, "alpha-lora", prompt=prompt))
    again = lora_server.metric("vllm:prefix_cache_hits_total")
    assert again - hits >= 32  # its own two full blocks
    tokens(complete(lora_server, "shared", prompt=prompt))
    tokens(complete(lora_server, "tiny", prompt=prompt))
    assert lora_server.metric("vllm:prefix_cache_hits_total") == again


def test_lora_requests_info_is_vllms_gauge(lora_server):
    samples = {labels: value for (name, labels), value in lora_server.metrics().items()
               if name == "vllm:lora_requests_info"}
    [(labels, value)] = samples.items()
    assert dict(labels) == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert abs(value - time.time()) < 60


def test_the_operators_loader_brings_a_real_server_to_the_desired_adapters(lora_server, adapter_dirs):
    """The contract between the operator's adapter loader and these routes: it reads /v1/models
    with the admin token, leaves what is loaded where spec wants it, loads what spec adds and
    unloads what spec drops."""
    from kvpilot.operator.adapter_loading import bring_in_line

    async def bring(desired):
        async with aiohttp.ClientSession(headers=ADMIN) as session:
            return await bring_in_line(session, "pod-0", lora_server.base_url, desired, "tiny")

    before = {name: card["root"] for name, card in listed(lora_server, headers=ADMIN).items() if name != "tiny"}
    assert {"shared", "alpha-lora", "beta-lora"} <= before.keys()
    added = asyncio.run(bring({**before, "from-spec": str(adapter_dirs["live"])}))
    assert added.failures == () and set(added.loaded) == {*before, "from-spec"}
    tokens(complete(lora_server, "from-spec"))
    removed = asyncio.run(bring(before))
    assert removed.failures == () and set(removed.loaded) == set(before)
    assert_openai_error(complete(lora_server, "from-spec"), 404, "model_not_found")


def test_the_load_routes_are_404_without_an_admin_token(server):
    assert_openai_error(load(server, "x", "/nowhere"), 404, "not_found")


@pytest.mark.parametrize("argv, complaint", [
    (["--lora-modules", "sql"], "argument --lora-modules: expected NAME=PATH, got 'sql'"),
    (["--lora-modules", '{"name": "sql"}'], 'argument --lora-modules: expected {"name": ..., "path": ...}'),
    (["--lora-modules", "sql=/adapters/sql"], "argument --lora-modules: needs --enable-lora"),
    (["--enable-lora", "--lora-modules", '{"name": "sql", "path": "/nowhere"}'],
     "argument --lora-modules: LoRA adapter 'sql' (/nowhere): no adapter_config.json"),
])
def test_bad_lora_modules_are_usage_errors_before_the_engine_starts(capsys, tiny_llama_dir, argv, complaint):
    from kvpilot.runtime import cli

    with pytest.raises(SystemExit) as raised:
        cli.main(["serve", str(tiny_llama_dir), *argv])
    assert raised.value.code == 2
    assert complaint in capsys.readouterr().err
