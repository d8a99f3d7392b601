"""Small GGUF files written with gguf's own writer, for the loader's unit tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]], arch: str = "llama") -> Path:
    """`tensors` maps a llama.cpp name to (stored array, its type): float arrays for F32/F16,
    quantized bytes ([rows, bytes per row], uint8) for the rest."""
    writer = GGUFWriter(str(path), arch)
    for name, (data, qtype) in tensors.items():
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
