"""The config spine: every engine setting is declared once, and EngineArgs and the serve flags follow it."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from kvpilot.runtime import cli
from kvpilot.runtime.config import (
    ENGINE_SETTINGS,
    CacheConfig,
    EngineArgs,
    KVEventsConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SchedulingPolicy,
)

CONFIG_CLASSES = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, LoRAConfig)


def _serve_parser() -> argparse.ArgumentParser:
    return cli.build_parser().parse_args(["serve"]).subparser


def _declared_settings() -> dict[str, dataclasses.Field]:
    declared = {}
    for cls in CONFIG_CLASSES:
        for f in dataclasses.fields(cls):
            if "setting" in f.metadata:
                declared[f.metadata["setting"].arg or f.name] = f
    return declared


def test_engine_args_are_exactly_the_declared_settings():
    declared = _declared_settings()
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    assert list(fields)[0] == "model"
    assert set(fields) - {"model"} == set(declared)
    for name, f in declared.items():
        assert fields[name].default == f.default, name


def test_every_setting_is_a_serve_flag_with_its_default_help_and_choices():
    actions = {action.dest: action for action in _serve_parser()._actions}
    for engine_setting in ENGINE_SETTINGS:
        action = actions[engine_setting.arg]
        assert action.option_strings[0] == "--" + engine_setting.arg.replace("_", "-")
        assert action.help == engine_setting.description.help and action.help
        assert action.default == engine_setting.default, engine_setting.arg
        if engine_setting.description.choices:
            assert list(action.choices) == list(engine_setting.description.choices)
    engine_group = next(g for g in _serve_parser()._action_groups if g.title == "engine")
    assert [a.dest for a in engine_group._group_actions] == [s.arg for s in ENGINE_SETTINGS]


def test_serve_flags_become_the_same_engine_args_as_the_keywords(monkeypatch, tiny_llama_dir):
    seen = []
    monkeypatch.setattr("kvpilot.runtime.server.launcher.run_server",
                        lambda engine_config, *args, **kwargs: seen.append(engine_config) or 0)
    flags = ["--max-num-seqs", "3", "--block-size", "8", "--no-enable-prefix-caching",
             "--scheduling-policy", "priority", "--gpu-memory-utilization", "0.5", "--max-model-len", "64"]
    assert cli.main(["serve", str(tiny_llama_dir), *flags]) == 0
    expected = EngineArgs(model=str(tiny_llama_dir), max_num_seqs=3, block_size=8, enable_prefix_caching=False,
                          scheduling_policy="priority", gpu_memory_utilization=0.5,
                          max_model_len=64).create_engine_config()
    assert seen == [expected]
    assert expected.scheduler.policy is SchedulingPolicy.PRIORITY


@pytest.mark.parametrize("kwargs, message", [
    ({"max_num_seqs": "4"}, "max_num_seqs must be int, got '4'"),
    ({"enable_prefix_caching": 1}, "enable_prefix_caching must be bool, got 1"),
    ({"num_gpu_blocks_override": True}, "num_gpu_blocks_override must be int, got True"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization must be greater than 0.0, got 0"),
    ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold must be a non-negative integer, got -1"),
    ({"scheduling_policy": "lifo"}, "scheduling_policy must be one of fcfs, priority, got 'lifo'"),
    ({"tensor_parallel_size": 2, "nnodes": 3}, "nnodes 3 does not divide the 2 ranks (tensor_parallel_size * "
                                               "pipeline_parallel_size)"),
    ({"nnodes": 1, "node_rank": 1, "headless": True}, "node_rank 1 is not below nnodes (1)"),
    ({"headless": True}, "headless is for every host but node 0, which runs the API server"),
    ({"master_port": 70000}, "master_port must be at most 65535, got 70000"),
    ({"max_lora_rank": 0}, "max_lora_rank must be a positive integer, got 0"),
    ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras (2) must be at least max_loras (4)"),
    ({"pipeline_parallel_size": 3}, "pipeline_parallel_size 3 is more stages than the model has layers (2)"),
    ({"pipeline_parallel_size": 2, "enable_lora": True}, "enable_lora is not supported with pipeline_parallel_size "
                                                         "above 1 yet: the adapters' slots assume every layer on each rank"),
])
def test_a_bad_value_is_named_by_its_setting(tiny_llama_dir, kwargs, message):
    with pytest.raises(ValueError) as err:
        EngineArgs(model=str(tiny_llama_dir), **kwargs).create_engine_config()
    assert str(err.value) == message


def test_serve_builds_the_config_once(monkeypatch, tiny_llama_dir):
    calls = []
    build = EngineArgs.create_engine_config
    monkeypatch.setattr(EngineArgs, "create_engine_config", lambda self: calls.append(self) or build(self))
    monkeypatch.setattr("kvpilot.runtime.server.launcher.run_server", lambda engine_config, *a, **k: 0)
    assert cli.main(["serve", str(tiny_llama_dir)]) == 0
    assert len(calls) == 1


def test_a_sliding_window_bounds_max_model_len(tiny_llama_dir, tiny_qwen2_dir, edited_checkpoint):
    # Mistral 7B v0.1's kind: 4096-token window, 32k positions. Within the window, full attention
    # (what the engine computes) is the same; beyond it, it is not.
    mistral = str(edited_checkpoint(tiny_llama_dir, architectures=["MistralForCausalLM"], model_type="mistral",
                                    sliding_window=64))
    assert EngineArgs(model=mistral).create_engine_config().scheduler.max_model_len == 64
    with pytest.raises(ValueError, match=r"max_model_len 65 exceeds the model's sliding_window \(64\)"):
        EngineArgs(model=mistral, max_model_len=65).create_engine_config()
    # Qwen2 configs name a window that only use_sliding_window turns on.
    qwen2 = str(edited_checkpoint(tiny_qwen2_dir, sliding_window=64, use_sliding_window=False))
    assert EngineArgs(model=qwen2).create_engine_config().scheduler.max_model_len == 2048
    qwen2_windowed = str(edited_checkpoint(tiny_qwen2_dir, sliding_window=64, use_sliding_window=True))
    assert EngineArgs(model=qwen2_windowed).create_engine_config().scheduler.max_model_len == 64


def test_an_activation_the_mlp_does_not_compute_is_refused(tiny_llama_dir, edited_checkpoint):
    gelu = str(edited_checkpoint(tiny_llama_dir, hidden_act="gelu"))
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        EngineArgs(model=gelu).create_engine_config()


def test_kv_events_are_off_unless_a_config_turns_them_on():
    assert EngineArgs(model="m").kv_events_config is None
    assert not KVEventsConfig().publishes
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").publishes


def test_the_kv_events_flag_takes_vllms_json(tiny_llama_dir):
    args = _serve_parser().parse_args([str(tiny_llama_dir), "--kv-events-config", json.dumps(
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:6000",
         "replay_endpoint": "tcp://*:6001", "topic": "kv@pod", "hwm": 10})])
    assert args.kv_events_config == KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:6000",
                                                   replay_endpoint="tcp://*:6001", topic="kv@pod", hwm=10)


@pytest.mark.parametrize("config, message", [
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown field(s) endpont; known: "),
    ('{"publisher": "kafka"}', "publisher must be one of zmq, null, got 'kafka'"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be bool, got 'yes'"),
    ('{"hwm": true}', "hwm must be int, got True"),
    ('{"max_queue_size": 0}', "max_queue_size must be a positive integer, got 0"),
    ('{"endpoint": "localhost:5557"}', "endpoint must be a tcp:// or ipc:// address, got 'localhost:5557'"),
    ('{"replay_endpoint": "tcp://*:5557"}', "endpoint and replay_endpoint must differ"),
    ('{"buffer_steps": 100}', "buffer_steps does not apply"),
    ('["zmq"]', "must be a JSON object"),
    ("{enable_kv_cache_events: true}", "not valid JSON"),
])
def test_a_bad_kv_events_config_is_a_usage_error_naming_the_field(capsys, config, message):
    with pytest.raises(SystemExit) as exit_:
        _serve_parser().parse_args(["--kv-events-config", config])
    assert exit_.value.code == 2
    assert f"argument --kv-events-config: {message}" in capsys.readouterr().err
