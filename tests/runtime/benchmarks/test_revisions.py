"""The --baseline helper: a revision's files and packages, and the check that a side imports them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpilot.runtime.benchmarks.revisions import REPO, baseline_env, check_imports_from, file_at, source_tree


def _head_has(path: str) -> bool:
    return subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"HEAD:{path}"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _head_has("runtime/request.py"), reason="needs a git checkout with history")
def test_a_baseline_tree_is_what_its_python_imports(tmp_path):
    tree = source_tree("HEAD", ("runtime",), tmp_path)
    assert (tree / "kvpilot" / "runtime" / "request.py").read_text() == file_at("HEAD", "runtime/request.py")
    env = baseline_env(tree, "kvpilot.runtime.request")
    imported = subprocess.run([sys.executable, "-c", "import kvpilot.runtime.request as m; print(m.__file__)"],
                              env=env, check=True, capture_output=True, text=True).stdout.strip()
    assert imported == str((tree / "kvpilot" / "runtime" / "request.py").resolve())


def test_a_side_that_imports_from_elsewhere_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="was meant to come from"):
        check_imports_from("kvpilot.runtime.request", tmp_path)
