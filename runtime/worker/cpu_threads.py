"""How many threads a CPU engine process gives its kernels: the cores it may run on, bounded by
its cgroup's CPU quota, shared among the ranks on the host.

torch sizes its thread pool from the cores it can see, never from a quota. A container limited
to 4 CPUs on a 64-core node (a Kubernetes `limits.cpu: 4`, `docker run --cpus 4`) would run one
thread per core of the node: the kernel throttles the container once the 4 CPUs' time is spent,
and a thread it stops holds every other one at the next OpenMP barrier. An OMP_NUM_THREADS set
by the user wins: it is their choice.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")


def quota_cpus(quota: str, period: str) -> int | None:
    """Whole CPUs a CFS quota allows (at least 1), or None where it sets no limit ("max", or -1
    in cgroup v1). Rounded down: a thread beyond the quota is one the kernel will stop."""
    if quota.strip() in ("max", "-1"):
        return None
    return max(1, math.floor(int(quota) / int(period)))


def threads_for(cores: int, quota: int | None, ranks: int) -> int:
    """Each of `ranks` processes' share of `cores` visible cores under a quota of `quota` CPUs."""
    usable = cores if quota is None else min(cores, quota)
    return max(1, usable // ranks)


def read_quota(membership: str, root: Path = CGROUP_ROOT) -> int | None:
    """The CPU quota of the cgroup that /proc/self/cgroup's text `membership` names and of its
    ancestors (each bounds those below it), in whole CPUs; None where none sets one or it cannot
    be read. cgroup v2's cpu.max, or v1's cpu controller (mounted at ROOT/cpu)."""
    quotas = []
    try:
        for line in membership.splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":  # v2's unified hierarchy
                hierarchy, files = root, ["cpu.max"]
            elif "cpu" in controllers.split(","):
                hierarchy, files = root / "cpu", ["cpu.cfs_quota_us", "cpu.cfs_period_us"]
            else:
                continue
            parts = [part for part in path.split("/") if part]
            for depth in range(len(parts) + 1):
                level = hierarchy.joinpath(*parts[:depth])
                if (level / files[0]).exists():
                    fields = " ".join((level / name).read_text() for name in files).split()
                    quotas.append(quota_cpus(*fields[:2]))
    except (OSError, ValueError, TypeError) as error:
        logger.warning("cannot read the cgroup CPU quota (%s): sizing threads from the visible cores", error)
        return None
    limits = [quota for quota in quotas if quota is not None]
    return min(limits) if limits else None


def set_engine_threads(ranks: int = 1) -> None:
    """Size torch's (and so every kernel's) thread pool for one of `ranks` processes on this host."""
    if os.environ.get("OMP_NUM_THREADS"):
        return
    cores, quota = len(os.sched_getaffinity(0)), read_quota(Path("/proc/self/cgroup").read_text())
    threads = threads_for(cores, quota, ranks)
    torch.set_num_threads(threads)
    limit = f", a CPU quota of {quota}" if quota is not None and quota < cores else ""
    logger.info("%d kernel threads: %d cores visible%s, %d rank(s) on this host (OMP_NUM_THREADS overrides)",
                threads, cores, limit, ranks)
