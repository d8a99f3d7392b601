"""What the API server does with an InferenceEngine before storing it, from the CRD file alone:
apply the schema's defaults, reject unknown fields (as `kubectl apply` does, with strict field
validation), check the OpenAPI schema, and evaluate the x-kubernetes-validations CEL rules.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "inferenceengines.kvpilot.dev.yaml"

Schema = dict[str, Any]


def load_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_FILE.read_text())


def engine_schema(crd: dict[str, Any] | None = None) -> Schema:
    (version,) = (crd or load_crd())["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def with_defaults(obj: Any, schema: Schema | None = None) -> Any:
    """A copy of `obj` with the schema's defaults filled in, recursively (defaults of objects
    that were themselves defaulted included), as the API server does."""
    schema = schema if schema is not None else engine_schema()
    obj = copy.deepcopy(obj)
    _default(obj, schema)
    return obj


def errors(obj: Any, schema: Schema | None = None) -> list[str]:
    """Why the API server would reject `obj` (already defaulted), one message per problem."""
    schema = schema if schema is not None else engine_schema()
    found = [
        f"{_dotted(error.absolute_path)}: {error.message}"
        for error in jsonschema.Draft4Validator(schema).iter_errors(obj)
    ]
    found += [f"{path}: unknown field" for path in _unknown_fields(obj, schema, "")]
    if not found:  # CEL rules run on objects that pass the schema, as in the API server
        found += [f"{path}: {message}" for path, message in _rule_failures(obj, schema, "")]
    return found


def schema_nodes(schema: Schema, path: str = "") -> Iterator[tuple[str, Schema]]:
    """Every schema node below `schema`, with its dotted path."""
    for name, child in schema.get("properties", {}).items():
        yield f"{path}.{name}", child
        yield from schema_nodes(child, f"{path}.{name}")
    if isinstance(schema.get("additionalProperties"), dict):
        yield f"{path}.*", schema["additionalProperties"]
        yield from schema_nodes(schema["additionalProperties"], f"{path}.*")
    if "items" in schema:
        yield f"{path}[]", schema["items"]
        yield from schema_nodes(schema["items"], f"{path}[]")


def _default(obj: Any, schema: Schema) -> None:
    if isinstance(obj, dict):
        for name, child in schema.get("properties", {}).items():
            if name not in obj and "default" in child:
                obj[name] = copy.deepcopy(child["default"])
            if name in obj:
                _default(obj[name], child)
        if isinstance(schema.get("additionalProperties"), dict):
            for value in obj.values():
                _default(value, schema["additionalProperties"])
    elif isinstance(obj, list) and "items" in schema:
        for item in obj:
            _default(item, schema["items"])


def _unknown_fields(obj: Any, schema: Schema, path: str) -> Iterator[str]:
    if schema.get("x-kubernetes-preserve-unknown-fields") or path == ".metadata":
        return
    if isinstance(obj, dict) and "properties" in schema:
        for name, value in obj.items():
            if name not in schema["properties"]:
                yield f"{path}.{name}".lstrip(".")
            else:
                yield from _unknown_fields(value, schema["properties"][name], f"{path}.{name}")
    elif isinstance(obj, list) and "items" in schema:
        for index, item in enumerate(obj):
            yield from _unknown_fields(item, schema["items"], f"{path}[{index}]")


def _rule_failures(obj: Any, schema: Schema, path: str) -> Iterator[tuple[str, str]]:
    for rule in schema.get("x-kubernetes-validations", []):
        if not _holds(rule["rule"], obj):
            where = f"{path}{rule.get('fieldPath', '')}".lstrip(".") or "<root>"
            # The API server reports messageExpression's text (message where it fails to evaluate;
            # here that fails the test instead).
            message = rule.get("message", f"failed rule: {rule['rule']}")
            if "messageExpression" in rule:
                message = str(_evaluated(rule["messageExpression"], obj))
            yield where, message
    if isinstance(obj, dict):
        for name, value in obj.items():
            child = schema.get("properties", {}).get(name)
            if child is None and isinstance(schema.get("additionalProperties"), dict):
                child = schema["additionalProperties"]
            if child is not None:
                yield from _rule_failures(value, child, f"{path}.{name}")
    elif isinstance(obj, list) and "items" in schema:
        for index, item in enumerate(obj):
            yield from _rule_failures(item, schema["items"], f"{path}[{index}]")


def _holds(rule: str, value: Any) -> bool:
    return bool(_evaluated(rule, value))


def _evaluated(expression: str, value: Any) -> Any:
    result = _program(expression).evaluate({"self": celpy.json_to_cel(value)})
    if isinstance(result, celpy.CELEvalError):
        raise AssertionError(f"{expression!r} failed to evaluate: {result}")
    return result


def _dotted(path: Any) -> str:
    return ".".join(str(part) for part in path) or "<root>"


@functools.cache
def _program(expression: str) -> Any:
    # Compiling is most of the cost of a check; the CRD has a few dozen expressions.
    environment = celpy.Environment()
    return environment.program(environment.compile(expression))
