"""What one pod's /metrics page costs the operator's control loop to read into a sample, in CPU.

Each interval the loop reads every ready pod's page (operator/samples.from_page) on its event
loop, while the other pods' reads time out around it: a fleet's worth of parsing delays them.
The page is the engine's own (its ServerMetrics renderer) after some traffic, one model name.
This tree's samples.py and --baseline's (a git revision: its operator/samples.py) parse the
same page, interleaved, --repeats times each; the table gives the min and median per page and
the ratio of the mins, and checks that both give the same sample.

    .venv/bin/python bench/operator_page_read.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from collections.abc import Callable

from kvpilot.operator import samples
from kvpilot.runtime.benchmarks.revisions import file_at
from kvpilot.runtime.server.metrics import ServerMetrics

# samples.py before the page was filtered to the wanted families.
BASELINE = "350f94e"


def engine_page() -> str:
    page = ServerMetrics("qwen", 16, 1000)
    page.kv_cache_usage.set(0.42)
    page.num_requests_waiting.set(3)
    page.num_requests_running.set(17)
    return page.render().decode()


def samples_at(revision: str) -> types.ModuleType:
    module = types.ModuleType(f"samples_{revision}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(file_at(revision, "operator/samples.py"), f"{revision}:operator/samples.py", "exec"), module.__dict__)
    return module


def per_page(read: Callable[[], object], calls: int) -> float:
    started = time.process_time()
    for _ in range(calls):
        read()
    return (time.process_time() - started) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=BASELINE, help="the git revision to compare with")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200, help="pages parsed per timing")
    args = parser.parse_args()

    page = engine_page()
    baseline = samples_at(args.baseline)
    ours, theirs = samples.from_page("p", page, 0.0), baseline.from_page("p", page, 0.0)
    same = (ours.kv_cache_usage, ours.num_waiting, ours.num_running, ours.num_finished) == (
        theirs.kv_cache_usage, theirs.num_waiting, theirs.num_running, theirs.num_finished)
    times: dict[str, list[float]] = {"baseline": [], "tree": []}
    for _ in range(args.repeats):
        times["baseline"].append(per_page(lambda: baseline.from_page("p", page, 0.0), args.calls))
        times["tree"].append(per_page(lambda: samples.from_page("p", page, 0.0), args.calls))
    base, tree = times["baseline"], times["tree"]
    print(f"| workload | lines | baseline {args.baseline} ms, min / median | this tree | ratio of mins | same sample |")
    print("|---|---|---|---|---|---|")
    print(f"| one engine page | {len(page.splitlines())} | {min(base) * 1e3:.3f} / {statistics.median(base) * 1e3:.3f}"
          f" | {min(tree) * 1e3:.3f} / {statistics.median(tree) * 1e3:.3f} | {min(base) / min(tree):.1f}x | {same} |")


if __name__ == "__main__":
    main()
