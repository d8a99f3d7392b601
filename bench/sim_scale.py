"""The fleet simulator at scale: BENCHMARKS.md's day of a thousand replicas (the diurnal trace at
140 requests/s, 1,000 + 6,000 tokens, the 70B FP8 profile, kvpilot), in CPU time.

By default it runs slices of that day (--slices: `night`, its first 20 minutes; `midday`, 300 s
from t = 40,000 s, started cold at the replicas the slice needs) with the simulator of this
working tree and with the one of --baseline (a git revision: its operator/sim/fleet.py and
replica.py), interleaved, --repeats times each, and reports the min and median CPU seconds, their
ratio, and whether the two gave the same result for every request. With --day it runs the whole
day once (with this tree's simulator, or --rev's) and reports its CPU time, events per CPU second
and peak RSS.

    .venv/bin/python bench/sim_scale.py --repeats 3
    .venv/bin/python bench/sim_scale.py --day
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
import types

import numpy as np

from kvpilot.operator.sim import fleet, profile, report, strategies, trace
from kvpilot.runtime.benchmarks.revisions import file_at

# The simulator before its array core (one heap of per-replica step events).
BASELINE = "d059f54"
# `minute`: the suite's smoke run.
SLICES = {"night": (0.0, 1200.0), "midday": (40000.0, 40300.0), "minute": (0.0, 60.0)}
PROFILE = profile.BUILTIN["h200-llama-70b-fp8"]
ENGINE = fleet.Engine(max_num_seqs=256, max_num_batched_tokens=8192, request_timeout_seconds=600.0,
                      startup_seconds=120.0)
SETTINGS = strategies.Settings(max_replicas=1000)
STRATEGY = "kvpilot"
TTFT_SLO = 2.0


def the_day(seed: int = 0) -> trace.Trace:
    """`kvpilot simulate --trace diurnal --rate 140 --prompt-tokens 1000 --output-tokens 6000`."""
    return trace.diurnal(140.0, trace.DAY, 1000, 6000, seed)


def cut(day: trace.Trace, start: float, end: float) -> trace.Trace:
    """The arrivals in [start, end), as a trace of its own from t = 0."""
    inside = (day.time >= start) & (day.time < end)
    return trace.Trace(day.time[inside] - start, day.tenant[inside], day.prompt[inside], day.output[inside],
                       day.tenants, end - start)


def simulator(rev: str | None) -> types.ModuleType:
    """fleet.py as of `rev` (with that revision's replica.py), or this tree's."""
    if rev is None:
        return fleet
    loaded: dict[str, types.ModuleType] = {}
    for name in ("replica", "fleet"):
        source = file_at(rev, f"operator/sim/{name}.py")
        module = types.ModuleType(f"sim_{name}_{rev}")
        sys.modules[module.__name__] = module  # dataclasses look their module up
        exec(compile(source, f"{rev}:operator/sim/{name}.py", "exec"), module.__dict__)
        loaded[name] = module
    loaded["fleet"].replica_model = loaded["replica"]
    return loaded["fleet"]


def run(module: types.ModuleType, load: trace.Trace, progress=None):
    sizes = fleet.sizes(load, PROFILE, ENGINE, SETTINGS.target_kv_cache_usage)
    loop = strategies.build(STRATEGY, SETTINGS, initial=sizes.initial, peak=sizes.peak, mean=sizes.mean)
    return module.simulate(load, loop, PROFILE, ENGINE, seed=0, progress=progress)


def same(a, b) -> bool:
    return (np.array_equal(a.first_token, b.first_token, equal_nan=True)
            and np.array_equal(a.finish, b.finish, equal_nan=True) and np.array_equal(a.outcome, b.outcome))


def slices(names: list[str], baseline: str, repeats: int) -> None:
    day = the_day()
    before = simulator(baseline)
    print(f"| workload | requests | baseline {baseline} CPU s, min / median | this tree | ratio of mins |"
          " requests per CPU s | identical |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        load = cut(day, *SLICES[name])
        times: dict[str, list[float]] = {"before": [], "after": []}
        results = {}
        for _ in range(repeats):
            for label, module in (("before", before), ("after", fleet)):
                results[label] = run(module, load)
                times[label].append(results[label].cpu_seconds)
        b, a = times["before"], times["after"]
        print(f"| {name} | {len(load)} | {min(b):.2f} / {statistics.median(b):.2f} |"
              f" {min(a):.2f} / {statistics.median(a):.2f} | {min(b) / min(a):.2f}x | {len(load) / min(a):.0f} |"
              f" {'yes' if same(results['before'], results['after']) else 'NO'} |")


def whole_day(rev: str | None) -> None:
    started = time.perf_counter()
    load = the_day()
    print(f"{len(load)} requests generated in {time.perf_counter() - started:.1f} s", flush=True)
    marks = iter(range(1_000_000, len(load) + 1_000_000, 1_000_000))
    mark = next(marks)
    cpu0 = time.process_time()

    def progress(done: int) -> None:
        nonlocal mark
        if done >= mark:
            print(f"  {done} requests, {time.process_time() - cpu0:.0f} CPU s", flush=True)
            mark = next(marks)

    result = run(simulator(rev), load, progress)
    summary = report.summary(result, TTFT_SLO)
    print(report.table([summary]))
    print(f"{result.events} events in {result.wall_seconds:.0f} s wall, {result.cpu_seconds:.1f} CPU s:"
          f" {result.events / result.cpu_seconds:.0f} events and {len(load) / result.cpu_seconds:.0f} requests"
          f" per CPU second; peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slices", default="night,midday", help="from " + ", ".join(SLICES))
    parser.add_argument("--baseline", default=BASELINE, help="the git revision compared with this tree")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--day", action="store_true", help="run the whole day once instead")
    parser.add_argument("--rev", help="--day: that revision's simulator instead of this tree's")
    args = parser.parse_args()
    if args.day:
        whole_day(args.rev)
        return
    names = [name for name in args.slices.split(",") if name]
    unknown = sorted(set(names) - set(SLICES))
    if unknown or not names:
        parser.error(f"unknown slice {', '.join(unknown) or repr(args.slices)}: from {', '.join(SLICES)}")
    slices(names, args.baseline, args.repeats)


if __name__ == "__main__":
    main()
