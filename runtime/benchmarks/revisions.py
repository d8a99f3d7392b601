"""Another git revision of this repository beside the working tree: what a bench script's --baseline runs.

A baseline is measured side by side with the working tree, in the same run, so each script takes
the revision's code straight out of git: one file's text (`file_at`), or whole packages as a folder
that, first on PYTHONPATH, makes `kvpilot.runtime` (or `kvpilot.kernels`) import from the revision
(`source_tree`, checked by `baseline_env`). Only a checkout has the history: these run from bench/.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def file_at(revision: str, path: str) -> str:
    """The text of `path` (relative to the repository's root) at `revision`."""
    return _git("show", f"{revision}:{path}").decode()


def source_tree(revision: str, packages: tuple[str, ...] = ("runtime", "kernels"), into: Path | None = None) -> Path:
    """A folder (`into`, else a new temporary one) holding `kvpilot/<package>` as of `revision`.

    The repository maps each top-level folder onto the `kvpilot` namespace (pyproject.toml); the
    folder repeats that map, so that it can stand first on a PYTHONPATH.
    """
    root = Path(tempfile.mkdtemp(prefix="kvpilot-baseline-")) if into is None else into
    archive = _git("archive", "--format=tar", revision, *packages)
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(root / "kvpilot", filter="data")
    return root


def baseline_env(tree: Path, module: str = "kvpilot.runtime") -> dict[str, str]:
    """This process's environment with `tree` first on PYTHONPATH, once a child process started
    with it was seen to import `module` from `tree` (the editable install must not win)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
    check_imports_from(module, tree.resolve(), env)
    return env


def check_imports_from(module: str, folder: Path, env: dict[str, str] | None = None) -> None:
    """RuntimeError unless a Python started with `env` imports `module` from under `folder`."""
    code = f"import {module} as m; print(m.__file__)"
    where = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    if not Path(where.stdout.strip()).resolve().is_relative_to(folder.resolve()):
        raise RuntimeError(f"{module} was meant to come from {folder} but came from {where.stdout.strip()}")


def _git(*args: str) -> bytes:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True).stdout
