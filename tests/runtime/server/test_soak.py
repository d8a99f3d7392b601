"""The soak of soak.py, scaled to 300 requests for `make test` (`make soak` runs 2,000)."""

from __future__ import annotations

from soak import RSS_TOLERANCE, soak


def test_a_soak_leaves_nothing_behind(server):
    report = soak(server, num_requests=300, concurrency=64, warmup=64)
    print("\n".join(report.lines()))
    assert report.requests == 300 and report.completed + report.dropped == 300
    assert report.dropped > 0 and report.completed > 0
    assert report.usage_errors == []
    assert report.rss_growth() <= RSS_TOLERANCE, report.lines()
