"""The run-time decision whether `--dtype bfloat16` runs on this CPU: a pure function of its flags."""

from __future__ import annotations

import pytest

from kvpilot.runtime import cli, cpu_bf16
from kvpilot.runtime.config import EngineArgs

# Flags of the machines these engines meet: a Xeon with AMX, an EPYC of the Zen 4 generation
# (AVX-512 BF16, no AMX), and AVX2-only parts (EPYC Zen 3, older Xeons).
SAPPHIRE_RAPIDS = {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
ZEN4 = {"avx2", "avx512f", "avx512_bf16", "avx512_vnni"}
ZEN3 = {"avx2", "fma", "f16c"}
AVX512_WITHOUT_BF16 = {"avx2", "avx512f", "avx512bw", "avx512_vnni"}


@pytest.mark.parametrize("flags", [SAPPHIRE_RAPIDS, ZEN4, {"amx_bf16"}], ids=["amx", "avx512-bf16", "amx-only"])
def test_a_cpu_with_avx512_bf16_or_amx_runs_bfloat16(flags):
    assert cpu_bf16.bfloat16_unsupported(flags) is None


@pytest.mark.parametrize("flags", [ZEN3, AVX512_WITHOUT_BF16, set()], ids=["avx2", "avx512", "none"])
def test_a_cpu_without_them_is_refused_with_the_reason(flags):
    reason = cpu_bf16.bfloat16_unsupported(flags)
    assert "AVX-512 BF16 or AMX" in reason and "--dtype float32" in reason


def test_the_engine_config_refuses_bfloat16_on_such_a_cpu(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(cpu_bf16, "cpu_flags", lambda: frozenset(ZEN3))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^dtype bfloat16 on a CPU needs AVX-512 BF16 or AMX"):
        EngineArgs(str(tiny_llama_dir), dtype="bfloat16").create_engine_config()
    assert EngineArgs(str(tiny_llama_dir), dtype="float32").create_engine_config().model.dtype == "float32"
    monkeypatch.setattr(cpu_bf16, "cpu_flags", lambda: frozenset(SAPPHIRE_RAPIDS))
    assert EngineArgs(str(tiny_llama_dir), dtype="bfloat16").create_engine_config().model.dtype == "bfloat16"


def test_this_machines_flags_are_read():
    """Whatever this CPU is, its flags come back (every x86 CPU since 2003 has sse2)."""
    flags = cpu_bf16.cpu_flags()
    assert "sse2" in flags or "asimd" in flags or "fp" in flags


def test_kvpilot_serve_refuses_it_as_a_usage_error(tiny_llama_dir, monkeypatch, capsys):
    monkeypatch.setattr(cpu_bf16, "cpu_flags", lambda: frozenset(AVX512_WITHOUT_BF16))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as raised:
        cli.main(["serve", str(tiny_llama_dir), "--dtype", "bfloat16"])
    assert raised.value.code == 2
    assert "argument --dtype: bfloat16 on a CPU needs AVX-512 BF16 or AMX" in capsys.readouterr().err
