"""``plan tune``: candidates, the keep rule, the correction fit, and the command end to end on 2 local ranks."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cost_models.cluster import load_cluster, memory_budget_bytes
from cost_models.corrections import (
    CorrectionRow,
    Corrections,
    apply_corrections,
    fit_corrections,
    scale_component,
)
from planner.api import prepare_model_file, tune_prepared
from planner.cli.main import main
from planner.errors import AutoplanError
from planner.methods import search_auto
from planner.tuning import Measurement, candidate_names, component_seconds
from tests.conftest import EXAMPLES

MLP = EXAMPLES / "mlp.py"
MLP_ARGS = {"hidden": 64, "layers": 2}


def _prepared():
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    return prepare_model_file(MLP, cluster, batch_size=8, model_args=MLP_ARGS)


def test_candidates_start_with_autos_pick_then_the_families_and_are_distinct() -> None:
    prepared = _prepared()
    result = search_auto(prepared).result
    names = candidate_names(result, count=10)
    assert names[0] == result.chosen_by
    families = [name for name in names if name in ("data-parallel", "megatron", "uniform-pipeline")]
    assert families == [name for name in ("data-parallel", "megatron", "uniform-pipeline") if name in families]
    keys = {
        (
            json.dumps([s.to_json() for s in result.priced[n].stages], sort_keys=True),
            result.priced[n].num_microbatches,
            result.priced[n].schedule,
        )
        for n in names
    }
    assert len(keys) == len(names)
    assert candidate_names(result, count=2) == names[:2]


def test_tune_keeps_the_measured_fastest_that_fits_and_skips_failures() -> None:
    prepared = _prepared()
    seen: list[str] = []

    def measure(name: str, plan) -> Measurement:
        seen.append(name)
        if len(seen) == 1:
            return Measurement(step_time_s=None, error="rank 0 failed: RuntimeError: boom")
        over = plan.memory_budget_bytes * 2 if len(seen) == 2 else 1.0
        return Measurement(step_time_s=0.01 * len(seen), peak_memory_bytes=(over, 1.0))

    result = tune_prepared(prepared, measure=measure, candidates=4)
    assert [row.name for row in result.rows] == seen and len(seen) >= 3
    assert result.chosen == 2  # the first failed, the second does not fit
    assert not result.rows[1].fits and result.rows[0].measurement.error
    assert any("plan tune kept this candidate" in note for note in result.plan.notes)


def test_tune_says_why_when_no_candidate_ran() -> None:
    def measure(name: str, plan) -> Measurement:
        return Measurement(step_time_s=None, error="out of memory")

    with pytest.raises(AutoplanError, match=r"no candidate ran.*out of memory"):
        tune_prepared(_prepared(), measure=measure, candidates=2)


def test_the_fit_recovers_known_factors_and_keeps_an_unexercised_one_near_one() -> None:
    truth = {"compute": 2.0, "communication": 1.0, "host": 3.0}
    rows = []
    for compute, host in ((1.0, 0.1), (0.2, 1.0), (0.5, 0.5), (2.0, 0.05)):
        parts = {"compute": compute, "communication": 0.0, "host": host}
        measured = sum(truth[c] * seconds for c, seconds in parts.items())
        rows.append(
            CorrectionRow(
                estimate_s=compute + host,
                components_s=parts,
                measured_s=measured,
                estimated_memory_bytes=100.0,
                measured_memory_bytes=110.0,
            )
        )
    fitted = fit_corrections(rows, prior_weight=1e-6)
    assert fitted.compute == pytest.approx(2.0, rel=1e-3) and fitted.host == pytest.approx(3.0, rel=1e-3)
    assert fitted.communication == pytest.approx(1.0) and fitted.memory == pytest.approx(1.1)
    assert fit_corrections([]) == Corrections()


def test_corrections_scale_what_they_name() -> None:
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    slower = apply_corrections(cluster, Corrections(compute=2.0, communication=3.0, host=4.0, memory=1.25))
    assert slower.device.peak_flops["float32"] == pytest.approx(cluster.device.peak_flops["float32"] / 2)
    assert slower.intra_node.bandwidth == pytest.approx(cluster.intra_node.bandwidth / 3)
    assert slower.intra_node.latency_s == pytest.approx(cluster.intra_node.latency_s * 3)
    assert slower.device.kernel_overhead_s == pytest.approx(cluster.device.kernel_overhead_s * 4)
    assert memory_budget_bytes(slower) == pytest.approx(memory_budget_bytes(cluster) / 1.25)
    assert dataclasses.replace(scale_component(cluster, "compute", 1.0), calibration=None) == cluster


def test_component_seconds_add_up_to_about_the_replayed_step() -> None:
    from planner.api import candidate_plan

    prepared = _prepared()

    plan = candidate_plan(prepared, "data-parallel")
    graph = prepared.graphs.at(plan.batch_size // plan.num_microbatches)
    seconds = component_seconds(plan, graph, prepared.setup)
    assert all(value >= 0 for value in seconds.values()) and seconds["compute"] > 0
    assert sum(seconds.values()) <= plan.estimate.step_time_s * 1.2


def _tune_args(out: Path, *extra: str) -> list[str]:
    """``plan tune`` of the small MLP on two local ranks, written to ``out``."""
    model = ["--model-arg", "hidden=64", "--model-arg", "layers=2"]
    return [
        "tune",
        str(MLP),
        "--cluster",
        "local-cpu",
        "--devices-per-node",
        "2",
        "--batch-size",
        "8",
        *model,
        "--out",
        str(out),
        *extra,
    ]


@pytest.mark.slow
def test_plan_tune_end_to_end_writes_the_plan_its_table_and_the_calibration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """On the preset's figures (--no-calibrate: no minute of calibration here), into a cache of its own."""
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("AUTOPLAN_CALIBRATE", "1")
    out = tmp_path / "tuned.json"
    args = _tune_args(out, "--candidates", "2", "--steps", "2", "--warmup", "1", "--no-calibrate")
    assert main(args) == 0
    printed = capsys.readouterr().out
    table = json.loads(out.with_suffix(".tune.json").read_text())
    assert len(table["rows"]) == 2 and sum(row["kept"] for row in table["rows"]) == 1
    assert all(row["measured_s"] > 0 and max(row["measured_peak_bytes"]) > 0 for row in table["rows"])
    kept = next(row for row in table["rows"] if row["kept"])
    assert kept["measured_s"] == min(row["measured_s"] for row in table["rows"])
    assert json.loads(out.read_text())["notes"][-1].startswith("plan tune kept this candidate")
    assert "learned:" in printed and out.with_suffix(".tune.md").is_file()
    from calibration.machine import planning_cluster

    learned = planning_cluster("local-cpu", num_nodes=1, devices_per_node=2, calibrate=True, say=print)
    assert learned.calibration is not None and "corrections" in learned.calibration


def test_ctrl_c_during_tune_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("planner.cli.tune.measure_locally", interrupted)
    out = tmp_path / "tuned.json"
    args = _tune_args(out)
    assert main(args) == 130
    assert not out.exists() and not out.with_suffix(".tune.md").exists()
    assert "interrupted after 0 of 4 candidates: nothing written" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--candidates", "0"], "--candidates must be at least 1"),
        (["--out", "/nowhere/x.json"], "directory /nowhere does not exist"),
    ],
)
def test_bad_tune_options_are_one_line(extra, message, capsys) -> None:
    args = ["tune", str(MLP), "--cluster", "local-cpu", "--devices-per-node", "2", "--batch-size", "8", *extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
