"""The packaging tests reuse the operator tests' helpers (CRD validation, the emulated API server
and its recorded requests) and the repository's scripts, so both folders go on sys.path, as
pytest does for a test folder itself."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]
for _folder in (_REPO / "tests" / "operator", _REPO / "scripts"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

from helm_cli import Helm, fetch_helm  # noqa: E402  (needs the paths above)


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm(fetch_helm(), tmp_path_factory.mktemp("helm-home"))
