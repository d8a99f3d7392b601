"""The profile's arithmetic, and the run-queue accounting that says what share of a core the engine got."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvpilot.operator.sim.calibrate import cpu_share, run_queue_seconds
from kvpilot.operator.sim.profile import Profile

PROFILE = Profile("test", "made up", base_s=0.01, per_token_s=1e-4, per_context_token_s=1e-6, num_gpu_blocks=64,
                  per_sequence_s=2e-3, cpu_share=0.8)


def test_a_step_costs_its_terms_and_a_saved_profile_loads_back_equal(tmp_path):
    assert PROFILE.step_seconds(512, 3, 900) == pytest.approx(0.01 + 512e-4 + 3 * 2e-3 + 900e-6)
    PROFILE.save(tmp_path / "profile.json")
    assert Profile.load(tmp_path / "profile.json") == PROFILE


def test_the_share_is_the_time_on_a_core_over_the_time_runnable():
    assert cpu_share((1.0, 2.0), (4.0, 3.0)) == pytest.approx(0.75)
    assert cpu_share((1.0, 2.0), (1.0, 5.0)) is None  # it never ran: no share to tell


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux's /proc")
def test_this_process_threads_run_on_a_core_while_busy():
    before = run_queue_seconds()
    spent = time.process_time() + 0.05
    while time.process_time() < spent:
        pass
    after = run_queue_seconds()
    assert after[0] > before[0] and after[1] >= before[1]
    assert 0 < cpu_share(before, after) <= 1
