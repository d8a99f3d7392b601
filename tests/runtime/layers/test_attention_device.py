"""Device mistakes without a GPU: the attention backends and a whole model step on the `meta` device.

An op mixing a meta tensor with a CPU tensor fails as it would on CUDA ("not on the expected
device"), so a mask or index built on the host by mistake (torch.arange without a device) is
caught here. Meta tensors carry no data, so these tests check devices and shapes only; the
numbers are the parity tests' job.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvpilot.runtime.config import EngineArgs
from kvpilot.runtime.core.sched.output import NewRequestData
from kvpilot.runtime.layers.attention import (CpuPagedAttention, TorchPagedAttention, TritonPagedAttention,
                                             resolve_attention_backend)
from kvpilot.runtime.models.loader import load_model
from kvpilot.runtime.request import SamplingParams
from kvpilot.runtime.worker.input_batch import InputBatch
from kvpilot.runtime.worker.step_inputs import StepBuffers, StepInputs

META = torch.device("meta")
BLOCK_SIZE = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def test_meta_catches_a_host_tensor_in_a_device_op():
    """What the tests below rely on: a CPU mask handed to SDPA on another device is an error."""
    q = torch.empty(1, HEADS, 3, HEAD_DIM, device=META)
    with pytest.raises(RuntimeError, match="device"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.bool))


def _mixed_step(padded_reqs: int | None = None):
    """A prefill chunk (cached prefix of 2, 5 new), a fresh prompt of 3 and a decode, on meta."""
    batch = InputBatch(max_num_reqs=8, max_model_len=32, max_blocks_per_req=8, device=torch.device("cpu"),
                       vocab_size=64)
    for req_id, tokens, blocks, computed in (("p", list(range(1, 8)), [1, 2], 2), ("f", [4, 5, 6], [3], 0),
                                             ("d", list(range(1, 7)), [4, 5], 5)):
        batch.add_request(NewRequestData(req_id=req_id, token_ids=tokens, num_prompt_tokens=len(tokens),
                                         sampling_params=SamplingParams(), block_ids=blocks,
                                         num_computed_tokens=computed))
    scheduled = {"p": 5, "f": 3, "d": 1} if padded_reqs is None else {"d": 1}
    step = StepInputs.build(batch, scheduled, BLOCK_SIZE)
    buffers = StepBuffers(max_num_tokens=16, max_num_reqs=8, max_blocks_per_req=8, device=META)
    return step, buffers.load(step, padded_reqs)


@pytest.mark.parametrize("padded_reqs", [None, 4])
def test_the_torch_backend_keeps_every_tensor_on_the_step_device(padded_reqs):
    step, (input_ids, positions, metadata) = _mixed_step(padded_reqs)
    assert {t.device for t in (input_ids, positions, metadata.slot_mapping, metadata.block_tables)} == {META}
    num_tokens = input_ids.shape[0]
    q = torch.empty(num_tokens, HEADS, HEAD_DIM, device=META)
    k = v = torch.empty(num_tokens, KV_HEADS, HEAD_DIM, device=META)
    kv_cache = torch.empty(2, 8, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=META)
    out = TorchPagedAttention().forward(q, k, v, kv_cache, metadata, scale=HEAD_DIM**-0.5)
    assert out.device == META and out.shape == q.shape


def test_the_cpu_backend_is_never_chosen_for_another_device_and_refuses_its_tensors():
    """The C kernel reads host memory through raw pointers: `auto` does not pick it off a CPU, and
    handed device tensors anyway it refuses them rather than dereferencing them."""
    assert resolve_attention_backend("auto", META.type) == "torch"
    _, (input_ids, _, metadata) = _mixed_step()
    num_tokens = input_ids.shape[0]
    q = torch.empty(num_tokens, HEADS, HEAD_DIM, device=META)
    k = v = torch.empty(num_tokens, KV_HEADS, HEAD_DIM, device=META)
    kv_cache = torch.empty(2, 8, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=META)
    with pytest.raises(ValueError, match="CPU tensors only"):
        CpuPagedAttention().forward(q, k, v, kv_cache, metadata, scale=1.0)


def test_the_triton_backend_hands_its_kernels_device_tensors_only():
    _, (input_ids, _, metadata) = _mixed_step()
    seen = []

    def record(*args):
        seen.extend(a.device for a in args if isinstance(a, torch.Tensor))
        return args[0]

    backend = TritonPagedAttention.__new__(TritonPagedAttention)
    backend._attend, backend._write = record, record
    num_tokens = input_ids.shape[0]
    q = torch.empty(num_tokens, HEADS, HEAD_DIM, device=META)
    k = v = torch.empty(num_tokens, KV_HEADS, HEAD_DIM, device=META)
    backend.forward(q, k, v, torch.empty(2, 8, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=META), metadata, 1.0)
    assert len(seen) >= 10 and set(seen) == {META}


def test_a_model_step_runs_on_meta(tiny_llama_dir):
    """The whole forward pass (embedding, RoPE, norms, attention, LM head) on the meta device."""
    config = EngineArgs(model=str(tiny_llama_dir)).create_engine_config()
    model = load_model(config.model, TorchPagedAttention(), META)
    for layer in model.attention_layers:
        layer.kv_cache = torch.empty(2, 8, BLOCK_SIZE, layer.num_kv_heads, layer.head_dim, device=META)
    _, (input_ids, positions, metadata) = _mixed_step()
    with torch.inference_mode():
        hidden = model(input_ids, positions, metadata)
        logits = model.compute_logits(hidden)
    assert hidden.device == META and logits.shape == (input_ids.shape[0], config.model.vocab_size)
