"""The spec -> `kvpilot serve` flag table against the CRD schema, the engine's flags and extraArgs' rule."""

from __future__ import annotations

import re

from crd_validation import engine_schema
from kvpilot.operator.serve_flags import RESERVED_FLAGS, SPEC_FLAGS
from kvpilot.runtime import cli
from kvpilot.runtime.config import BLOCK_SIZES, ENGINE_SETTINGS


def _spec_schema() -> dict:
    return engine_schema()["properties"]["spec"]["properties"]


def _schema_at(path: tuple[str, ...]) -> dict:
    node = {"properties": _spec_schema()}
    for key in path:
        node = node["properties"][key]
    return node


def _serve_flags() -> set[str]:
    return set(cli.build_parser().parse_args(["serve"]).subparser._option_string_actions)


def test_every_engine_field_is_mapped_and_every_mapped_field_exists():
    mapped = {spec_flag.path for spec_flag in SPEC_FLAGS}
    engine_fields = {("engine", key) for key in _spec_schema()["engine"]["properties"]} - {("engine", "extraArgs")}
    assert engine_fields <= mapped
    for path in mapped:
        assert _schema_at(path)["type"] in ("string", "integer", "number", "boolean"), path


def test_every_mapped_flag_is_one_kvpilot_serve_accepts():
    accepted = _serve_flags()
    for spec_flag in SPEC_FLAGS:
        assert spec_flag.flag in accepted, spec_flag.flag
        if _schema_at(spec_flag.path)["type"] == "boolean":
            assert "--no-" + spec_flag.flag.removeprefix("--") in accepted
    assert {"--host", "--port", "--tenants-file", "--admin-token-file", "--api-key"} <= accepted


def test_a_field_named_otherwise_than_its_flag_says_why():
    for spec_flag in SPEC_FLAGS:
        words = spec_flag.flag.removeprefix("--").split("-")
        camel = words[0] + "".join(word.title() for word in words[1:])
        assert (spec_flag.path[-1] == camel) != bool(spec_flag.renamed_because), spec_flag


def test_extra_args_refuses_exactly_the_mapped_and_reserved_flags():
    node = _spec_schema()["engine"]["properties"]["extraArgs"]
    (rule,) = node["x-kubernetes-validations"]
    refused = re.search(r"\^--\(no-\)\?\(([^)]*)\)", rule["rule"]).group(1).split("|")
    expected = {f.flag for f in SPEC_FLAGS} | set(RESERVED_FLAGS)
    assert {"--" + name for name in refused} == expected
    assert all(RESERVED_FLAGS.values())


def test_crd_bounds_agree_with_the_engine_settings():
    settings = {s.arg: s.description for s in ENGINE_SETTINGS}
    engine = _spec_schema()["engine"]["properties"]
    assert tuple(engine["blockSize"]["enum"]) == BLOCK_SIZES == settings["block_size"].choices
    assert engine["blockSize"]["default"] == next(s.default for s in ENGINE_SETTINGS if s.arg == "block_size")
    for field, arg in (("maxNumSeqs", "max_num_seqs"), ("maxNumBatchedTokens", "max_num_batched_tokens"),
                       ("maxModelLen", "max_model_len")):
        assert engine[field]["minimum"] == settings[arg].minimum, field
    gpu = engine["gpuMemoryUtilization"]
    assert (gpu["minimum"], gpu["exclusiveMinimum"], gpu["maximum"]) == (settings["gpu_memory_utilization"].above,
                                                                         True, settings["gpu_memory_utilization"].maximum)
