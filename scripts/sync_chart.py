"""Refresh the Helm chart's copies of files whose single source lives elsewhere in the repository.

Helm cannot read files outside the chart's folder, so the chart carries byte-for-byte copies:
- every CRD in crds/ goes to charts/kvpilot/crds/ (Helm installs that folder before the templates);
- operator/rbac.yaml goes to charts/kvpilot/files/rbac.yaml (templates/rbac.yaml renders its rules);
- examples/engine.yaml goes to charts/kvpilot/files/example-engine.yaml (the exampleEngine value).

`make chart-sync` runs this; tests/packaging fails while a copy differs from its source.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHART = Path("charts") / "kvpilot"
FILES = {
    Path("operator") / "rbac.yaml": CHART / "files" / "rbac.yaml",
    Path("examples") / "engine.yaml": CHART / "files" / "example-engine.yaml",
}


def copies(repo: Path = REPO) -> dict[Path, Path]:
    """Source -> copy, both as paths relative to `repo`."""
    crds = sorted(path.relative_to(repo) for path in (repo / "crds").glob("*.yaml"))
    return {**FILES, **{crd: CHART / crd for crd in crds}}


def sync(repo: Path = REPO) -> list[Path]:
    """Make every copy equal its source and drop chart CRDs that have no source any more;
    returns the paths it changed."""
    pairs = copies(repo)
    changed = []
    for source, copy in pairs.items():
        if not (repo / copy).is_file() or (repo / copy).read_bytes() != (repo / source).read_bytes():
            shutil.copyfile(repo / source, repo / copy)
            changed.append(copy)
    for orphan in (repo / CHART / "crds").glob("*"):
        if orphan.relative_to(repo) not in pairs.values():
            orphan.unlink()
            changed.append(orphan.relative_to(repo))
    return changed


def main() -> int:
    for path in sync():
        print(f"updated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
