"""Host syncs on the step path, counted without a GPU (torch.cuda's sync debug mode needs one).

The engine runs on the Triton backend (interpreted here). Every call that would make the host
wait for a CUDA device is recorded when kvpilot's runner, layers, models or kernel wrappers make
it: reading a value (.item, .tolist, .cpu, bool/int/float of a tensor), nonzero and boolean-mask
indexing (their result's size is on the device), and copies to a device that block (`.to(device)`
and `torch.tensor(..., device=...)` without non_blocking: from pageable memory they wait for the
stream). A step may wait once: for its sampled tokens, at its end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import kvpilot.kernels
import kvpilot.runtime.layers
import kvpilot.runtime.models
import kvpilot.runtime.worker
from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.worker.model_runner import ModelRunner

_WATCHED = tuple(str(Path(package.__file__).parent) for package in
                 (kvpilot.runtime.worker, kvpilot.runtime.layers, kvpilot.runtime.models))
_KERNELS = Path(kvpilot.kernels.__file__).parent


def _watched(filename: str) -> bool:
    path = Path(filename)
    return filename.startswith(_WATCHED) or path.parent == _KERNELS


class _SyncRecorder:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sites: list[tuple[str, str, str]] | None = None
        for name in ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__"):
            self._wrap(monkeypatch, torch.Tensor, name, lambda *args, **kwargs: True)
        self._wrap(monkeypatch, torch.Tensor, "__getitem__", lambda self, index: _has_bool_tensor(index))
        self._wrap(monkeypatch, torch.Tensor, "to", _blocking_device_copy)
        self._wrap(monkeypatch, torch, "tensor", lambda *args, **kwargs: kwargs.get("device") is not None)
        self._wrap(monkeypatch, torch, "nonzero", lambda *args, **kwargs: True)

    def _wrap(self, monkeypatch, owner, name: str, syncs) -> None:
        original = getattr(owner, name)
        recorder = self

        def wrapper(*args, **kwargs):
            if recorder.sites is not None:
                caller = sys._getframe(1)
                if _watched(caller.f_code.co_filename) and syncs(*args, **kwargs):
                    recorder.sites.append((Path(caller.f_code.co_filename).name, caller.f_code.co_name, name))
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)


def _has_bool_tensor(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts)


def _blocking_device_copy(tensor, *args, **kwargs) -> bool:
    device = kwargs.get("device", args[0] if args and isinstance(args[0], (torch.device, str)) else None)
    return device is not None and tensor.device.type == "cpu" and not kwargs.get("non_blocking", False)


def _record_steps(llm: LLM, monkeypatch, prompts, params) -> list:
    """(SchedulerOutput, sync sites) of every step that generating `prompts` takes."""
    recorder = _SyncRecorder(monkeypatch)
    steps = []
    execute_model = ModelRunner.execute_model

    def recorded(runner, scheduler_output):
        recorder.sites = []
        try:
            return execute_model(runner, scheduler_output)
        finally:
            steps.append((scheduler_output, recorder.sites))
            recorder.sites = None

    monkeypatch.setattr(ModelRunner, "execute_model", recorded)
    llm.generate(prompts, params)
    return steps


SAMPLED = [("model_runner.py", "_sample", "tolist")]


def test_a_step_waits_for_its_sampled_tokens_only(tiny_llama_dir, monkeypatch):
    # Chunked prefill: steps with a partial chunk (nothing sampled), mixed steps, pure decodes.
    llm = LLM(str(tiny_llama_dir), attention_backend="triton", block_size=4, max_num_seqs=4,
              max_num_batched_tokens=8)
    steps = _record_steps(llm, monkeypatch, [list(range(1, 13)), [6, 7, 8]],
                          SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert [sites for _, sites in steps if sites not in ([], SAMPLED)] == []
    kinds = {(len(set(output.num_scheduled_tokens.values())) > 1, bool(sites)) for output, sites in steps}
    assert kinds >= {(True, True), (False, True), (False, False)}  # mixed, decode and a partial chunk


def test_the_logits_adjustments_and_sampling_filters_do_not_wait(tiny_llama_dir, monkeypatch):
    llm = LLM(str(tiny_llama_dir), attention_backend="triton", block_size=4, max_num_seqs=4)
    params = [
        SamplingParams(max_tokens=4, temperature=0.8, seed=3, top_k=5, top_p=0.9, min_p=0.01),
        SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.2, presence_penalty=0.3,
                       frequency_penalty=0.2, logit_bias={5: 1.0}, min_tokens=2, bad_words_token_ids=[[9]]),
        SamplingParams(max_tokens=4, allowed_token_ids=[3, 4, 5, 6]),
    ]
    steps = _record_steps(llm, monkeypatch, [[1, 2, 3], [6, 7, 8, 9], [4, 5]], params)
    assert len(steps) >= 4 and all(sites == SAMPLED for _, sites in steps), [sites for _, sites in steps]
