"""A CPU engine's thread count: the visible cores, bounded by the cgroup's CPU quota, shared by the
host's ranks; read from cgroup files laid out as v1 and v2 lay them out, and once in a real
cgroup with a quota."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvpilot.runtime.worker.cpu_threads import quota_cpus, read_quota, threads_for


def test_a_quota_is_its_whole_cpus_and_max_is_none():
    assert quota_cpus("max", "100000") is None
    assert quota_cpus("-1\n", "100000\n") is None
    assert quota_cpus("400000", "100000") == 4
    assert quota_cpus("150000", "100000") == 1  # a second thread would be stopped half the time
    assert quota_cpus("20000", "100000") == 1


def test_threads_are_the_usable_cores_shared_by_the_ranks():
    assert threads_for(64, 4, ranks=1) == 4
    assert threads_for(64, None, ranks=2) == 32
    assert threads_for(2, 8, ranks=1) == 2  # a quota above the visible cores adds none
    assert threads_for(8, 3, ranks=2) == 1
    assert threads_for(1, None, ranks=4) == 1


def _write(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def test_cgroup_v2_reads_the_own_and_the_ancestors_cpu_max(tmp_path):
    _write(tmp_path, {"cpu.max": "max 100000\n"})
    _write(tmp_path / "kubepods", {"cpu.max": "600000 100000\n"})
    _write(tmp_path / "kubepods" / "pod1", {"cpu.max": "max 100000\n"})
    assert read_quota("0::/kubepods/pod1\n", tmp_path) == 6  # the parent's quota bounds the pod
    _write(tmp_path / "kubepods" / "pod1", {"cpu.max": "250000 100000\n"})
    assert read_quota("0::/kubepods/pod1\n", tmp_path) == 2
    assert read_quota("0::/\n", tmp_path) is None


def test_cgroup_v1_reads_the_cpu_controllers_quota(tmp_path):
    cpu = tmp_path / "cpu"
    _write(cpu, {"cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n"})
    _write(cpu / "docker" / "abc", {"cpu.cfs_quota_us": "300000\n", "cpu.cfs_period_us": "100000\n"})
    membership = "4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n"
    assert read_quota(membership, tmp_path) == 3
    assert read_quota("2:cpu,cpuacct:/\n", tmp_path) is None


def test_an_unreadable_quota_is_said_and_sizes_from_the_cores(tmp_path, caplog):
    _write(tmp_path, {"cpu.max": "lots 100000\n"})
    with caplog.at_level(logging.WARNING, logger="kvpilot.runtime.worker.cpu_threads"):
        assert read_quota("0::/\n", tmp_path) is None
    assert "cannot read the cgroup CPU quota" in caplog.text


PROBE = ("from kvpilot.runtime.worker.cpu_threads import set_engine_threads; import torch;"
         " set_engine_threads(); print(torch.get_num_threads())")


def _threads_in(cgroup: Path | None, env: dict[str, str]) -> int:
    enter = f"echo $$ > {cgroup / 'cgroup.procs'}; " if cgroup else ""
    result = subprocess.run(["sh", "-c", f'{enter}exec "{sys.executable}" -c "{PROBE}"'], env=env,
                            capture_output=True, text=True, timeout=120, check=True)
    return int(result.stdout.split()[-1])


def test_an_engine_process_in_a_cgroup_with_a_quota_of_one_cpu_runs_one_thread():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one visible core: a quota of one CPU changes nothing here")
    cpu = Path("/sys/fs/cgroup/cpu")
    own = Path("/sys/fs/cgroup")
    parent = cpu if (cpu / "cpu.cfs_quota_us").exists() else own if (own / "cpu.max").exists() else None
    if parent is None or not os.access(parent, os.W_OK):
        pytest.skip("no writable cgroup CPU controller here (needs root, cgroup v1's cpu or v2's cpu.max)")
    cgroup = parent / f"kvpilot-test-{uuid.uuid4().hex[:8]}"
    cgroup.mkdir()
    try:
        if parent == cpu:
            (cgroup / "cpu.cfs_quota_us").write_text("100000")
        else:
            (cgroup / "cpu.max").write_text("100000 100000")
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        assert _threads_in(None, env) == len(os.sched_getaffinity(0))
        assert _threads_in(cgroup, env) == 1
        assert _threads_in(cgroup, {**env, "OMP_NUM_THREADS": "2"}) == 2  # the user's choice wins
    finally:
        cgroup.rmdir()
