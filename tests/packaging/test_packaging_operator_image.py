"""The operator image installs kvpilot with the `operator` extra alone (see the Dockerfile): no
torch, no CUDA. `kvpilot operator --help` and every module of kvpilot.operator must therefore load
with nothing but that extra's dependencies; a test in tests/operator checks torch in particular."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# Prints the files of the modules loaded by the operator's command line and package.
PROBE = """
import contextlib, io, json, pkgutil, sys
before = set(sys.modules)
from kvpilot.runtime import cli
with contextlib.redirect_stdout(io.StringIO()):
    try:
        cli.main(["operator", "--help"])
    except SystemExit as exit:
        assert exit.code == 0, exit.code
import kvpilot.operator
for module in pkgutil.iter_modules(kvpilot.operator.__path__, "kvpilot.operator."):
    __import__(module.name)
print(json.dumps([getattr(sys.modules[name], "__file__", None) for name in set(sys.modules) - before]))
"""


def installed_with(extra: str) -> set[str]:
    """The distributions that `pip install kvpilot[extra]` installs, by canonical name."""
    declared = [Requirement(text) for text in importlib.metadata.distribution("kvpilot").requires or []]
    wanted = [r for r in declared if r.marker is not None and r.marker.evaluate({"extra": extra})]
    found: set[str] = set()
    while wanted:
        requirement = wanted.pop()
        name = canonicalize_name(requirement.name)
        if name in found:
            continue
        found.add(name)
        for text in importlib.metadata.distribution(name).requires or []:
            nested = Requirement(text)
            if nested.marker is None or nested.marker.evaluate({"extra": ""}):
                wanted.append(nested)
    return found


def third_party_distributions(files: list[str | None]) -> set[str]:
    """The distributions in site-packages that the loaded module files belong to."""
    site_packages = {Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")}
    owners = importlib.metadata.packages_distributions()
    found = set()
    for file in filter(None, files):
        for root in site_packages:
            if Path(file).is_relative_to(root):
                top_level = Path(file).relative_to(root).parts[0].split(".")[0]
                found.update(canonicalize_name(owner) for owner in owners.get(top_level, [top_level]))
    return found


def test_the_operator_needs_only_the_operator_extra() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True,
    )
    loaded = third_party_distributions(json.loads(done.stdout))
    assert "kopf" in loaded, "the probe loaded the operator"
    allowed = installed_with("operator")
    assert "torch" not in allowed
    assert loaded - allowed == set(), "needed by the operator, but not installed in its image"
