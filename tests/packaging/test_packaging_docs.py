"""README.md: its CRD reference is what scripts/crd_reference.py generates from the CRD and names
every field, and the install sections point at files that exist."""

from __future__ import annotations

import re

import crd_reference
from crd_validation import REPO, engine_schema, load_crd, schema_nodes

README = REPO / "README.md"


def test_crd_reference_is_fresh() -> None:
    text = README.read_text()
    assert crd_reference.updated(text, load_crd()) == text, "run `make crd-reference`"


def test_crd_reference_names_every_field() -> None:
    reference = crd_reference.reference(load_crd())
    rows = set(re.findall(r"^\| `([^`]+)` \|", reference, flags=re.MULTILINE))
    sections = set(re.findall(r"^#### (\w+)$", reference, flags=re.MULTILINE))
    # A list's items and a map's values are described on the row of the list or map itself.
    fields = {re.sub(r"(\[\]|\.\*)$", "", path.lstrip(".")) for path, _ in schema_nodes(engine_schema())}
    assert sections == {"spec", "status"}
    assert fields - {"apiVersion", "kind", "metadata"} == rows | sections


def test_crd_reference_follows_the_crd() -> None:
    crd = load_crd()
    tenants = engine_schema(crd)["properties"]["spec"]["properties"]["scheduling"]["properties"]["tenants"]
    tenants["items"]["properties"]["priority"]["maximum"] = 999
    assert "| `spec.scheduling.tenants[].priority` | integer | `0` | Higher is more important, as for a " \
           "PriorityClass. -1000 to 999. |" in crd_reference.reference(crd)


def test_install_sections_exist() -> None:
    headings = re.findall(r"^## (.+)$", README.read_text(), flags=re.MULTILINE)
    assert {"Install on Kubernetes", "Upgrading CRDs", "CRD reference"} <= set(headings)


def test_paths_in_the_readme_exist() -> None:
    paths = set(re.findall(r"\b((?:charts|crds|examples|scripts)/[\w./-]*\w/?)", README.read_text()))
    assert {"charts/kvpilot", "charts/kvpilot/crds/", "examples/engine-tenants.yaml"} <= paths
    assert [path for path in paths if not (REPO / path).exists()] == []
