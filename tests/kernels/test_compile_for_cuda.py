"""The CUDA build of every kernel launch, made here without a GPU (see compile_for_cuda.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("compile_for_cuda.py")
KERNELS = ("_paged_attention_kernel", "_merge_splits_kernel", "_reshape_and_cache_kernel", "_rms_norm_kernel",
           "_rotary_kernel", "_shrink_kernel", "_expand_kernel", "_dequant_matmul_kernel")


def test_every_launch_compiles_to_a_cubin_for_sm90(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    # A fresh cache: every launch is compiled in this run, none is read back from an earlier one.
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    run = subprocess.run([sys.executable, str(SCRIPT), "90"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    reports = [line for line in run.stdout.splitlines() if line.startswith("sm_90 ")]
    compiled = [line.split()[1] for line in reports]
    assert set(compiled) == set(KERNELS)
    # A spill goes to local memory on every loop trip; the block sizes are chosen to have none.
    assert [line for line in reports if "0 bytes spill stores" not in line] == []
    assert run.stdout.rstrip().endswith(f"{len(compiled)} launches compiled")
