"""kernels/cpu/build.py: compiled once per source (and flags, compiler, CPU), errors that say why."""

from __future__ import annotations

import pytest

from kvpilot.kernels.cpu import build


@pytest.fixture
def sources(monkeypatch, tmp_path):
    """C sources in a scratch folder, built into a scratch cache, with load()'s memo cleared."""
    monkeypatch.setattr(build, "SOURCE_DIR", tmp_path)
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "cache"))
    build.load.cache_clear()
    yield tmp_path
    build.load.cache_clear()


def test_a_built_kernel_is_cached_by_its_source(sources):
    (sources / "seven.c").write_text("int seven(void) { return 7; }\n")
    assert build.load("seven").seven() == 7
    [library] = (sources / "cache").iterdir()
    build.load.cache_clear()
    assert build.load("seven").seven() == 7 and list((sources / "cache").iterdir()) == [library]
    (sources / "seven.c").write_text("int seven(void) { return 8; }\n")
    build.load.cache_clear()
    assert build.load("seven").seven() == 8 and len(list((sources / "cache").iterdir())) == 2


def test_a_failed_build_shows_the_compiler_error_and_leaves_nothing(sources):
    (sources / "broken.c").write_text("int f(void) { return undeclared; }\n")
    with pytest.raises(build.KernelBuildError, match="(?s)compiling broken.c failed.*undeclared"):
        build.load("broken")
    assert not list((sources / "cache").iterdir())


def test_no_compiler_is_a_clear_error(sources, monkeypatch):
    (sources / "seven.c").write_text("int seven(void) { return 7; }\n")
    monkeypatch.setenv(build.CC_ENV, "no-such-cc")
    with pytest.raises(build.KernelBuildError, match="no C compiler: 'no-such-cc' is not on PATH"):
        build.load("seven")


def test_an_unwritable_cache_is_a_clear_error(sources, monkeypatch):
    (sources / "seven.c").write_text("int seven(void) { return 7; }\n")
    (sources / "file").write_text("")
    monkeypatch.setenv(build.CACHE_ENV, str(sources / "file" / "cache"))
    with pytest.raises(build.KernelBuildError, match="cannot write the kernel cache folder"):
        build.load("seven")
