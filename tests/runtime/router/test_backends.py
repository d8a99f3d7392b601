"""Replica URLs: from the command line (a usage error when bad) and from a file re-read as it changes."""

import asyncio
import logging

import pytest

from kvpilot.runtime.cli import main
from kvpilot.runtime.router.backends import Endpoint, backend_url, parse_url_file, watch_url_file


@pytest.mark.parametrize("text, url", [
    ("http://10.0.0.7:8000", "http://10.0.0.7:8000"),
    ("  http://engine-0.engines:8000/ ", "http://engine-0.engines:8000"),
    ("https://[fd00::7]:8443", "https://[fd00::7]:8443"),
    ("http://localhost", "http://localhost"),
])
def test_a_replica_url_is_normalized(text, url):
    assert backend_url(text) == url


@pytest.mark.parametrize("text, problem", [
    ("10.0.0.7:8000", "not an http:// or https:// URL"),
    ("ftp://host:21", "not an http:// or https:// URL"),
    ("http://:8000", "names no host"),
    ("http://host:99999", "not a URL"),
    ("http://host:8000/v1", "has a path or query"),
])
def test_a_bad_replica_url_says_what_is_wrong(text, problem):
    with pytest.raises(ValueError, match=problem):
        backend_url(text)


def test_a_bad_backend_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["router", "--backend", "host:8000"])
    assert exit_.value.code == 2
    assert "argument --backend: 'host:8000' is not an http:// or https:// URL" in capsys.readouterr().err


def test_a_backends_file_skips_comments_blank_and_bad_lines(tmp_path, caplog):
    text = "# the fleet\nhttp://a:8000\n\nnot a url\nhttp://b:8000  # second\nhttp://a:8000/\n"
    with caplog.at_level(logging.ERROR):
        endpoints = parse_url_file(text, tmp_path / "backends")
    assert endpoints == [Endpoint("http://a:8000"), Endpoint("http://b:8000")]
    assert "line 4 skipped" in caplog.text


async def test_the_file_is_read_again_when_it_changes_and_a_missing_one_is_no_replica(tmp_path, caplog):
    path = tmp_path / "backends"
    published = []
    watcher = asyncio.create_task(watch_url_file(path, published.append, interval=0.01))
    try:
        await _eventually(lambda: published == [[]])
        assert "cannot be read" in caplog.text
        path.write_text("http://a:8000\n")
        await _eventually(lambda: published[-1] == [Endpoint("http://a:8000")])
        path.write_text("")
        await _eventually(lambda: published[-1] == [])
        assert "names no replica" in caplog.text
    finally:
        watcher.cancel()


async def _eventually(condition, timeout=5.0):
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met")

