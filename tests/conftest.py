"""Session-wide fixtures: tiny checkpoints are built once and shared by every test; the real model
(SmolLM2-135M-Instruct, GGUF) is fetched once per checkout into .cache/."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

# Triton decides at `@triton.jit` time whether a kernel is interpreted, so this precedes every
# import of kvpilot.kernels. Without a GPU the interpreter is the only way the kernels run; on a
# CUDA machine, TRITON_INTERPRET=0 runs the same tests compiled.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make(tmp_path_factory, "tiny-llama", arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make(tmp_path_factory, "tiny-qwen2", arch="qwen2")


@pytest.fixture(scope="session")
def tiny_llama3_rope_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make(tmp_path_factory, "tiny-llama3-rope", arch="llama", llama3_rope_scaling=True)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from kvpilot.runtime.models.default_model import ensure_default_model

    return ensure_default_model(Path(__file__).parents[1] / ".cache" / "kvpilot")


@pytest.fixture(scope="session")
def operator_calls(tmp_path_factory: pytest.TempPathFactory) -> set[tuple[str, str, str]]:
    """The API rights the real operator used over a scenario that runs each of its code paths
    (tests/operator/operator_api_calls.py): recorded once, for operator/rbac.yaml's test and for
    the chart's RBAC test, since the scenario takes the operator ~20 s."""
    # tests/operator is on sys.path for the tests that ask for this (pytest puts it there for its
    # own tests; tests/packaging/conftest.py for the chart's).
    from operator_api_calls import recorded_calls

    return recorded_calls(tmp_path_factory.mktemp("rbac"))


@pytest.fixture(scope="session")
def make_peft_adapter() -> Callable[..., Path]:
    """`make_peft_adapter(base_dir, out_dir, seed=0, **lora_config)`: a PEFT LoRA adapter folder made
    on the checkpoint (rank 4, alpha 8 on q, v and down unless told), with random non-zero B matrices
    (PEFT's default zeros would change nothing)."""
    return _make_peft_adapter


@pytest.fixture
def edited_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """`edited_checkpoint(source, **fields)`: a copy of a checkpoint folder whose config.json has
    `fields` set (a checkpoint of another kind, without building one)."""
    copies = iter(range(1_000))

    def edit(source: Path, **fields: Any) -> Path:
        folder = tmp_path / f"edited-checkpoint-{next(copies)}"
        shutil.copytree(source, folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **fields}))
        return folder

    return edit


def _make(tmp_path_factory: pytest.TempPathFactory, name: str, **kwargs: Any) -> Path:
    # Imported on first use: suites without torch (the operator's) share this conftest.
    from kvpilot.runtime.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp(name), **kwargs)


def _make_peft_adapter(base_dir: Path, out_dir: Path, seed: int = 0, **lora_config: Any) -> Path:
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    options = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], **lora_config}
    peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **options)).save_pretrained(out_dir)
    return out_dir
