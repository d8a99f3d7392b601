"""Instruction-set levels for the CPU kernels, chosen at run time by what this CPU and its OS run.

A kernel source built per level (`-m` flags, never `-march=native`) is probed once per process
in a child that runs the library's self-check: a CPU may advertise an instruction its VM or OS
traps (llama.cpp's native build died with SIGILL on such a VM), and the child dies instead of
the server. The best level that survives is used; `$KVPILOT_CPU_ISA` forces one (tests and
benches), and asking for a level this machine cannot run is an error that says why.

AVX-512 VNNI, BF16 and FP16 are left out on purpose: their dot products take int8 or 16-bit
activations, and the kernels' contract is float32 activations (nothing quantized silently).
"""

from __future__ import annotations

import functools
import os
import platform
import signal
import subprocess
import sys
from pathlib import Path

from kvpilot.kernels.cpu.build import COMMON_FLAGS, KernelBuildError, library_path

ISA_ENV = "KVPILOT_CPU_ISA"
_X86 = platform.machine().lower() in ("x86_64", "amd64")
# Best first: (cpuinfo flags the level needs, compiler flags). scalar is the baseline of the
# architecture (SSE2 on x86-64), always there.
_BASE = ("-march=x86-64", "-mtune=generic") if _X86 else ()
_AVX2 = ("-mavx2", "-mfma", "-mf16c")
LEVELS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    **({"avx512": (frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}),
                   (*_BASE, *_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")),
        "avx2": (frozenset({"avx2", "fma", "f16c"}), (*_BASE, *_AVX2))} if _X86 else {}),
    "scalar": (frozenset(), _BASE),
}
_PROBE = "import ctypes, sys; sys.exit(getattr(ctypes.CDLL(sys.argv[1]), sys.argv[2])())"
_PROBE_TIMEOUT_S = 60


def library(source: Path, level: str) -> Path:
    """The library built from `source` for `level` (compiled now unless cached)."""
    return library_path(source, (*LEVELS[level][1], *COMMON_FLAGS))


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    return frozenset(word for line in lines if line.split(":")[0].strip() == "flags"
                     for word in line.split(":", 1)[1].split())


def why_not(source: Path, level: str, self_check: str) -> str | None:
    """None when `level` runs here; otherwise why not. Probes once per process and source."""
    return _why_not(source, level, self_check, cpu_flags())


@functools.cache
def _why_not(source: Path, level: str, self_check: str, cpu_flags: frozenset[str]) -> str | None:
    if level not in LEVELS:
        return f"unknown ISA level {level!r} (levels: {', '.join(LEVELS)})"
    missing = LEVELS[level][0] - cpu_flags
    if missing:
        return f"the CPU does not advertise {', '.join(sorted(missing))}"
    try:
        path = library(source, level)
    except KernelBuildError as error:
        return f"it does not build: {error}"
    try:
        done = subprocess.run([sys.executable, "-I", "-c", _PROBE, str(path), self_check], capture_output=True,
                              timeout=_PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"its self-check did not finish in {_PROBE_TIMEOUT_S} s"
    if done.returncode < 0:
        return f"its self-check died with {signal.Signals(-done.returncode).name} (the CPU or the OS traps it)"
    if done.returncode:
        return f"its self-check computed wrong results (code {done.returncode}): {done.stderr.decode()[-300:]}"
    return None


def runnable(source: Path, self_check: str) -> list[str]:
    """The levels that run here, best first (scalar last, unless even it fails)."""
    return [level for level in LEVELS if why_not(source, level, self_check) is None]


def choose(source: Path, self_check: str) -> str:
    """`$KVPILOT_CPU_ISA` when set (an error if it cannot run here), else the best level that runs."""
    wanted = os.environ.get(ISA_ENV, "").strip()
    if wanted:
        reason = why_not(source, wanted, self_check)
        if reason:
            raise KernelBuildError(f"${ISA_ENV}={wanted} cannot run on this machine: {reason}")
        return wanted
    levels = runnable(source, self_check)
    if not levels:
        raise KernelBuildError(f"no ISA level of {source.name} runs here: scalar: "
                               f"{why_not(source, 'scalar', self_check)}")
    return levels[0]
