"""Whether this CPU computes in bfloat16 natively, decided at run time from what the CPU and the OS
enable (the machines here change from day to day: an Intel Xeon with AMX, an AMD EPYC without).

torch's bfloat16 matmuls on a CPU run in oneDNN, which uses AVX-512 BF16 (`vdpbf16ps`) or AMX tiles
where it has them. Without either it widens to float32 around every op, which is slower than running
float32 outright: `--dtype bfloat16` on such a CPU is refused with the reason, never run slowly.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

# The /proc/cpuinfo flags of the two instruction sets, either of which serves.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def bfloat16_unsupported(flags: Collection[str]) -> str | None:
    """Why a CPU with these instruction-set flags cannot run `--dtype bfloat16` well, or None."""
    if any(flag in flags for flag in BF16_FLAGS):
        return None
    return ("bfloat16 on a CPU needs AVX-512 BF16 or AMX (the CPU flags avx512_bf16 or amx_bf16, enabled by "
            "the OS), and this CPU has neither: its bfloat16 matmuls would be emulated, slower than float32. "
            "Use --dtype float32")


def cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags as the OS enables them. Linux lists a flag in /proc/cpuinfo
    only when it manages the flag's register state (it drops the AVX-512 and AMX flags when XSAVE
    does not cover them); torch reads CPUID and XCR0 itself, and a BF16 flag it does not confirm
    is dropped as well."""
    import torch

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    flags = {flag for line in lines if line.split(":")[0].strip() in ("flags", "Features")
             for flag in line.split(":", 1)[1].split()}
    confirmed = {"avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "amx_bf16": torch.cpu._is_amx_tile_supported()}
    return frozenset(flag for flag in flags if confirmed.get(flag, True))


def check_bfloat16_here() -> None:
    """Raises ValueError with the reason when the engine would run bfloat16 on a CPU without BF16."""
    import torch

    if torch.cuda.is_available():
        return
    reason = bfloat16_unsupported(cpu_flags())
    if reason is not None:
        raise ValueError(f"dtype {reason}")
