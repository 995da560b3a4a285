"""The held-out fidelity benchmark's pieces that need no timing: the sets, the keep rule, the
per-world scores, the machine shares and the memory peak from allocation events."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.fidelity_sets import (
    PROBE_MODEL_FILES,
    SCORED,
    Attempt,
    Case,
    Timing,
    check_disjoint,
    keep,
    pick_timing,
    spearman,
    world_summary,
)
from executors.measure.memory_peak import peak_from_events, step_peak_bytes
from executors.measure.step_timing import machine_shares

ROOT = Path(__file__).resolve().parent.parent


def test_probe_and_scored_sets_are_disjoint() -> None:
    check_disjoint()
    probe_files = {(ROOT / f).resolve() for f in PROBE_MODEL_FILES}
    assert all(case.path.resolve() not in probe_files for case in SCORED.values())
    assert all(case.path.exists() for case in SCORED.values())
    from calibration.probes import COMPUTE_PROBE_FILE, PROBE_FILE

    assert {PROBE_FILE.resolve(), COMPUTE_PROBE_FILE.resolve()} <= probe_files  # the files the calibration runs


def test_check_disjoint_refuses_a_scored_probe_model() -> None:
    leak = {"probe": Case(model="../calibration/probe_model.py", args={}, batch=16, method="data-parallel")}
    with pytest.raises(ValueError, match="probe model"):
        check_disjoint(leak)


def test_scored_set_covers_the_required_families_and_methods() -> None:
    models = {case.model for case in SCORED.values()}
    assert {"gpt.py", "resnet.py", "moe.py"} <= models
    assert any(model.startswith("zoo/hf_") for model in models) and any(m.startswith("zoo/nn_") for m in models)
    methods = {(case.method, case.options.get("schedule")) for case in SCORED.values()}
    assert {("data-parallel", None), ("auto", None), ("megatron", "1f1b"), ("megatron", "gpipe")} <= methods


def test_keep_rule_picks_by_disturbance_only() -> None:
    quiet = Timing(attempt=2, measured_s=0.9, steal_share=0.0, foreign_share=0.05)
    noisy = Timing(attempt=1, measured_s=0.1, steal_share=0.2, foreign_share=0.3)
    assert pick_timing([noisy, quiet]) is quiet  # the quiet timing, whatever the estimate would say
    tie = Timing(attempt=3, measured_s=0.5, steal_share=0.05, foreign_share=0.0)
    assert pick_timing([tie, quiet]) is quiet  # equal disturbance: the earlier attempt
    attempts = [
        Attempt(world=2, index=1, timings={"a@2": noisy, "b@2": quiet}, load_before=1, load_after=1, wall_s=1),
        Attempt(world=2, index=2, timings={"a@2": quiet, "b@2": noisy}, load_before=1, load_after=1, wall_s=1),
    ]
    kept = keep(attempts)
    assert kept["a@2"] is quiet and kept["b@2"] is quiet
    import inspect

    assert list(inspect.signature(pick_timing).parameters) == ["timings"]  # nothing about estimates reaches it


def test_world_summary_and_spearman() -> None:
    measured = {"a": 1.0, "b": 2.0, "c": 4.0}
    summary = world_summary(2, {"a": 1.1, "b": 1.5, "c": 4.0}, measured)
    assert summary.mape == pytest.approx((0.1 + 0.25 + 0.0) / 3)
    assert summary.worst_key == "b" and summary.worst_error == pytest.approx(-0.25)
    assert summary.within_20 == 2 and summary.within_30 == 3 and summary.spearman == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(0.8660254)  # ties take their average rank


def test_machine_shares_subtract_our_own_cpu_time() -> None:
    before, after = (10, 100, 1000), (30, 700, 2000)  # (steal, busy, total) ticks
    shares = machine_shares(before, after, ours_ticks=400)
    assert shares["steal"] == pytest.approx(0.02) and shares["foreign"] == pytest.approx(0.2)
    assert machine_shares(before, after, ours_ticks=900)["foreign"] == 0.0  # never negative


def test_peak_from_synthetic_events() -> None:
    events = [(5, -100), (1, 400), (2, 300), (3, -400), (4, 600)]  # out of order on purpose
    # sorted: +400 (400), +300 (700), -400 (300), +600 (900), -100 (800)
    assert peak_from_events(events) == 900
    assert peak_from_events([]) == 0
    assert peak_from_events([(1, -50)]) == 0  # a free of a block from before the window


def test_step_peak_bytes_sees_a_transient_tensor() -> None:
    numel = 1 << 20  # 4 MiB of float32, freed before the step returns

    def step() -> None:
        transient = torch.ones(numel)
        del transient

    peak = step_peak_bytes(step)
    assert 4 * numel <= peak < 4 * numel + (1 << 16)
