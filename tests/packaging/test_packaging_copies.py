"""The chart's copies of files from elsewhere in the repository (Helm reads nothing outside the
chart): the CRD, the operator's RBAC rules and the example engine are byte-identical to their
single sources, and `make chart-sync` (scripts/sync_chart.py) repairs them when they are not."""

from __future__ import annotations

import shutil
from pathlib import Path

from crd_validation import REPO
from sync_chart import CHART, sync


def differences(repo: Path) -> list[str]:
    """What is wrong with the chart's copies in `repo`, checked from the sources' side."""
    found = []
    crds = sorted(path.name for path in (repo / "crds").glob("*"))
    copied_crds = sorted(path.name for path in (repo / CHART / "crds").glob("*"))
    if copied_crds != crds:
        found.append(f"the chart's CRDs are {copied_crds}, not {crds}")
    pairs = [(Path("crds") / name, CHART / "crds" / name) for name in crds if name in copied_crds] + [
        (Path("operator") / "rbac.yaml", CHART / "files" / "rbac.yaml"),
        (Path("examples") / "engine.yaml", CHART / "files" / "example-engine.yaml"),
    ]
    for source, copy in pairs:
        if not (repo / copy).is_file() or (repo / copy).read_bytes() != (repo / source).read_bytes():
            found.append(f"{copy} differs from {source}")
    return found


def test_chart_copies_are_byte_identical_to_their_sources() -> None:
    assert differences(REPO) == [], "run `make chart-sync`"


def test_sync_repairs_stale_copies(tmp_path: Path) -> None:
    for folder in ("crds", "operator", "examples", CHART):
        shutil.copytree(REPO / folder, tmp_path / folder)
    crd = tmp_path / CHART / "crds" / "inferenceengines.kvpilot.dev.yaml"
    crd.write_text(crd.read_text().replace("maxItems: 64", "maxItems: 65"))
    (tmp_path / CHART / "files" / "rbac.yaml").unlink()
    (tmp_path / CHART / "crds" / "removed.kvpilot.dev.yaml").write_text("kind: CustomResourceDefinition\n")
    assert len(differences(tmp_path)) == 3

    changed = sync(tmp_path)

    assert differences(tmp_path) == []
    assert sorted(map(str, changed)) == sorted(str(CHART / path) for path in (
        "crds/inferenceengines.kvpilot.dev.yaml", "files/rbac.yaml", "crds/removed.kvpilot.dev.yaml",
    ))
    assert sync(tmp_path) == [], "nothing left to do"
