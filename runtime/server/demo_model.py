"""The model `kvpilot serve` runs without MODEL_DIR: a tiny checkpoint, built once into the user's cache."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

DEMO_MODEL_NAME = "tiny-llama"


def demo_model_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "kvpilot" / DEMO_MODEL_NAME


def ensure_demo_model() -> Path:
    target = demo_model_dir()
    if target.is_dir():
        return target
    # Imported here: building needs torch and transformers, serving an existing folder does not.
    from kvpilot.runtime.tiny_model import make_tiny_model

    print(f"kvpilot: building the demo model into {target} (first run only)", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built aside, then renamed into place in one step: an interrupted build leaves no half model,
    # and of two concurrent builds one wins the rename.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{DEMO_MODEL_NAME}-") as scratch:
        built = make_tiny_model(Path(scratch) / DEMO_MODEL_NAME)
        try:
            built.rename(target)
        except OSError:
            if not target.is_dir():
                raise
    return target
