"""The checkpoint the side-by-side bench/ scripts share when given none: a 4-layer, hidden-256
llama with GQA (random weights, fixed seed), big enough that the model's matmuls, not Python,
set the step time on a CPU."""

from __future__ import annotations

import tempfile

DESCRIPTION = "the 4-layer, hidden-256 bench llama (8 heads over 2 KV heads, vocab 2048, random weights)"


def bench_model_dir() -> str:
    # Imported here: tiny_model brings torch and transformers (seconds), which the scripts that
    # only talk HTTP to a server never need when given --model.
    from kvpilot.runtime.tiny_model import make_tiny_model

    return str(make_tiny_model(tempfile.mkdtemp(prefix="kvpilot-bench-"), num_layers=4, hidden_size=256,
                               num_heads=8, num_kv_heads=2, vocab_size=2048))
