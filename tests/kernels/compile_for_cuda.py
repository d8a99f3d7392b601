"""Compile every kernel launch the wrappers make, down to a cubin for a CUDA target, on a machine
without a GPU: Triton's own compiler and its bundled ptxas need no device.

Run in a process without TRITON_INTERPRET (the kernels must be JIT functions, not interpreted).
Each wrapper is called on meta tensors; its launches are recorded instead of run, then compiled
as Triton's launcher would compile them: its own binder gives the argument types, the
specialisations (16-byte aligned pointers, strides divisible by 16, an int of 1 made a constant)
and the launch options (warps, stages). A compile without the specialisations is another
kernel, with other registers and spills. This proves the CUDA path builds; it does not run it.

    .venv/bin/python tests/kernels/compile_for_cuda.py [ARCH]    # ARCH: 90 (H100/H200, default), 80 (A100)
"""

from __future__ import annotations

import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from kvpilot.kernels.cpu.quant_matmul import PackedWeight, pack_int8
from kvpilot.kernels.dequant_matmul import dequant_matmul
from kvpilot.kernels.lora import lora_apply
from kvpilot.kernels.paged_attention import paged_attention
from kvpilot.kernels.reshape_and_cache import reshape_and_cache
from kvpilot.kernels.rms_norm import rms_norm
from kvpilot.kernels.rotary import rotary_embedding

launches: list[tuple[JITFunction, tuple, dict]] = []


def _record(self, grid):
    return lambda *args, **kwargs: launches.append((self, args, kwargs))


def compile_launch(fn: JITFunction, args: tuple, kwargs: dict, target: GPUTarget):
    backend = make_backend(target)
    bound, specialization, options = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), target=target,
                          options=options.__dict__)


def register_report(kernel, arch: int) -> str:
    """ptxas's own account of registers and spills for the kernel's PTX."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(kernel.asm["ptx"])
        ptx.flush()
        run = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a" if arch >= 90 else f"--gpu-name=sm_{arch}",
                              ptx.name, "-o", "/dev/null"], capture_output=True, text=True, check=True)
    lines = [line.split("info    :")[-1].strip() for line in run.stderr.splitlines() if "registers" in line or "spill" in line]
    return "; ".join(lines)


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def attention(num_tokens, num_reqs, num_heads, num_kv_heads, head_dim, block_size, max_query_len, num_splits,
              dtype, index_dtype=torch.int32):
    cache = meta(2, 64, block_size, num_kv_heads, head_dim, dtype=dtype)
    paged_attention(meta(num_tokens, num_heads, head_dim, dtype=dtype), cache[0], cache[1],
                    meta(num_reqs, 8, dtype=index_dtype), meta(num_reqs + 1, dtype=index_dtype),
                    meta(num_reqs, dtype=index_dtype), head_dim**-0.5, max_query_len, 4096, num_splits=num_splits)


def main() -> int:
    target = GPUTarget("cuda", int(sys.argv[1]) if len(sys.argv) > 1 else 90, 32)
    JITFunction.__getitem__ = _record
    # Decode at GQA 4, head_dim 128, block 16: one pass, and split-K (which adds the merge).
    attention(64, 64, 32, 8, 128, 16, 1, 1, torch.bfloat16)
    attention(4, 4, 32, 8, 128, 16, 1, 4, torch.bfloat16)
    # The same two with the int64 metadata the engine's step buffers hold.
    attention(64, 64, 32, 8, 128, 16, 1, 1, torch.bfloat16, torch.int64)
    attention(4, 4, 32, 8, 128, 16, 1, 4, torch.bfloat16, torch.int64)
    # Prefill chunks of a Llama-3-8B-shaped layer (GQA 4, head_dim 128), as the engine launches them.
    attention(600, 8, 32, 8, 128, 16, 512, 1, torch.bfloat16, torch.int64)
    # A mixed batch with prefill chunks, head_dim 64; the tiny test model's fp32 shapes; Qwen2's odd group.
    attention(600, 8, 16, 16, 64, 16, 512, 1, torch.float16)
    attention(40, 4, 4, 2, 16, 4, 20, 1, torch.float32)
    attention(40, 4, 14, 2, 64, 16, 20, 1, torch.bfloat16)
    cache = meta(2, 64, 16, 8, 128)
    reshape_and_cache(meta(256, 8, 128), meta(256, 8, 128), cache[0], cache[1], meta(256, dtype=torch.int64))
    rms_norm(meta(256, 4096), meta(4096), 1e-6, meta(256, 4096))
    rms_norm(meta(256, 576), meta(576), 1e-6)
    qkv = meta(256, (32 + 2 * 8) * 128)
    rotary_embedding(meta(256, dtype=torch.int64), qkv[:, :4096].view(256, 32, 128),
                     qkv[:, 4096:5120].view(256, 8, 128), meta(4096, 128, dtype=torch.float32)[:, :64],
                     meta(4096, 128, dtype=torch.float32)[:, :64])
    # Four adapters of rank 16 on a Llama-3-8B q projection, for a decode batch of 64 rows.
    lora_apply(meta(64, 4096), meta(64, 4096), meta(4, 16, 4096), meta(4, 4096, 16),
               meta(64, dtype=torch.int64), meta(4, dtype=torch.float32))
    # SmolLM2's gate/up at 16 tokens in its file's Q4_1, and the other decodings (Q5's bits, bytes, int8).
    for qtype, row_bytes in (("Q4_1", 360), ("Q5_0", 396), ("Q8_0", 612)):
        dequant_matmul(meta(16, 576, dtype=torch.float32),
                       PackedWeight(qtype, 1536, 576, torch.zeros(1536, row_bytes, dtype=torch.uint8)))
    dequant_matmul(meta(16, 576, dtype=torch.float32), pack_int8(torch.zeros(1536, 576)))
    for fn, args, kwargs in launches:
        kernel = compile_launch(fn, args, kwargs, target)
        assert kernel.asm["cubin"], fn.__name__
        shape = ", ".join(f"{name}={value}" for name, value in kwargs.items()
                          if name.startswith(("BLOCK", "HEAD_DIM", "QUER", "NUM_SPLITS", "num_")))
        print(f"sm_{target.arch} {fn.__name__} [{shape}]: {kernel.metadata.shared} B shared; "
              f"{register_report(kernel, target.arch)}")
    print(f"{len(launches)} launches compiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
