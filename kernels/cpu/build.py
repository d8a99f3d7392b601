"""C kernels for the CPU: compiled on first use with the system C compiler, cached, loaded with ctypes.

`load("paged_attention")` compiles `kernels/cpu/paged_attention.c` into a shared library and
returns it as a `ctypes.CDLL`. The library is named after a hash of what makes it: the source,
the flags, the compiler's identity and the CPU (`-march=native` code must not be loaded by a
machine with fewer instruction sets, e.g. through a shared home folder). So a changed source
or another machine builds its own copy and nothing stale is ever loaded.

Plain C with OpenMP rather than a torch C++ extension: compiling against torch's headers takes
minutes on a loaded 2-core machine, a C file about a second. The kernels take raw pointers,
sizes and strides; the callers check dtypes and layouts. A library linked with `-fopenmp` needs
`libgomp.so.1`, which torch has already loaded from its own wheel: both share one thread pool.
ctypes releases the GIL for the duration of every call.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
# The compiler is `$CC` when set, else `cc`; `$KVPILOT_KERNEL_CACHE` overrides the cache folder.
CC_ENV, CACHE_ENV = "CC", "KVPILOT_KERNEL_CACHE"
# -Wno-psabi: the kernels' 64-byte vectors never cross a call boundary (all inlined), so GCC's
# note that passing them would change the ABI below AVX-512 (an error under -Werror on an AVX2
# machine) does not apply.
COMMON_FLAGS = ("-std=c11", "-O3", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-shared", "-Wall", "-Werror",
                "-Wno-psabi")
# -march=native: the library is built on the machine that runs it (the CPU is in its hash). The
# quantized matmul instead builds one library per ISA level with explicit flags (isa.py).
FLAGS = ("-march=native", *COMMON_FLAGS)
_COMPILE_TIMEOUT_S = 300


class KernelBuildError(RuntimeError):
    """A C kernel could not be compiled or loaded; the message says why."""


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvpilot" / "kernels"


@functools.cache
def load(name: str) -> ctypes.CDLL:
    """The library built from `kernels/cpu/<name>.c` (compiled now unless cached). Raises
    KernelBuildError when there is no compiler or the build fails."""
    return load_source(SOURCE_DIR / f"{name}.c")


def load_source(source: Path, flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """The library built from any C file, as `load` builds its own (a benchmark builds an older
    revision's source beside the current one); `flags` replace the default compiler flags."""
    target = library_path(source, flags)
    try:
        return ctypes.CDLL(str(target))
    except OSError as error:
        raise KernelBuildError(f"built {target} but could not load it: {error}") from error


def library_path(source: Path, flags: tuple[str, ...] = FLAGS) -> Path:
    """The cached library built from `source` with `flags`, compiled now unless already there."""
    compiler = _compiler()
    target = cache_dir() / f"{source.stem}-{_build_key(source, compiler, flags)}.so"
    if not target.is_file():
        _compile(compiler, source, target, flags)
    return target


def _compiler() -> list[str]:
    command = shlex.split(os.environ.get(CC_ENV) or "cc")
    if not command or shutil.which(command[0]) is None:
        raise KernelBuildError(f"no C compiler: {command[0] if command else '$CC'!r} is not on PATH "
                               f"(install gcc, or point ${CC_ENV} at one)")
    return command


def _build_key(source: Path, compiler: list[str], flags: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(compiler + list(flags)).encode(), _compiler_identity(tuple(compiler)),
                 _cpu_identity()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


@functools.cache
def _compiler_identity(compiler: tuple[str, ...]) -> bytes:
    done = subprocess.run([*compiler, "--version"], capture_output=True, timeout=60)
    return done.stdout


@functools.cache
def _cpu_identity() -> bytes:
    """The CPU's model and instruction-set flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join([platform.machine(), platform.processor(), *dict.fromkeys(wanted)]).encode()


def _compile(compiler: list[str], source: Path, target: Path, flags: tuple[str, ...]) -> None:
    """Compiles into a temporary name beside the target, then renames: processes building the
    same library at once each rename a whole file, and a reader never sees a partial one."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem}-", suffix=".so")
    except OSError as error:
        raise KernelBuildError(f"cannot write the kernel cache folder {target.parent} ({error}): "
                               f"point ${CACHE_ENV} at a writable one") from error
    os.close(fd)
    try:
        command = [*compiler, *flags, "-o", scratch, str(source), "-lm"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired as error:
            raise KernelBuildError(f"compiling {source.name} took over {_COMPILE_TIMEOUT_S} s") from error
        if done.returncode != 0:
            raise KernelBuildError(f"compiling {source.name} failed ({shlex.join(command)}):\n{done.stderr.strip()}")
        os.replace(scratch, target)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
