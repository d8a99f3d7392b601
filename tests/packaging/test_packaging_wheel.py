"""What gets installed: the wheel holds every module of runtime/, kernels/ and operator/ (and the C
kernels' sources) under kvpilot.*, and the repository root's operator/ folder never shadows the standard library's
`operator` (it has no __init__.py for that reason, see operator/README.md)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from crd_validation import REPO

# The folders that setup.py maps onto the kvpilot namespace.
PACKAGE_FOLDERS = ("runtime", "kernels", "operator")


def test_import_operator_from_the_repository_root_is_the_standard_library() -> None:
    # -S: without site, nothing has imported `operator` before the root ('' in sys.path) is in
    # place. A venv's .pth files import it first, which would hide a shadowing folder.
    code = ("import sys; assert sys.path[0] == '' and 'operator' not in sys.modules; import operator;"
            "print(operator.__file__); assert operator.itemgetter(1)('ab') == 'b'")
    env = {name: value for name, value in os.environ.items() if name != "PYTHONSAFEPATH"}
    done = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == Path(sysconfig.get_path("stdlib")) / "operator.py"


def test_the_wheel_holds_every_module(tmp_path: Path) -> None:
    # Built from a copy: an in-tree build would leave build/ behind, whose stale files can leak
    # into later wheels.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py"):
        shutil.copy(REPO / name, source / name)
    for folder in PACKAGE_FOLDERS:
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(tmp_path / "dist"), str(source)],
        check=True, capture_output=True, timeout=120,
    )
    [wheel] = (tmp_path / "dist").glob("kvpilot-*.whl")
    # Python modules, and the C sources that kernels/cpu/ compiles on first use.
    packaged = {name for name in zipfile.ZipFile(wheel).namelist() if name.endswith((".py", ".c"))}
    expected = {f"kvpilot/{path.relative_to(source).as_posix()}"
                for folder in PACKAGE_FOLDERS for pattern in ("*.py", "*.c") for path in (source / folder).rglob(pattern)}
    assert packaged == expected
