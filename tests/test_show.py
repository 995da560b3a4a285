"""``plan show``: a plan's summary, its simulated step as JSON, and its figure; bad input is one line."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from cost_models.cluster import load_cluster
from cost_models.simulator import Span
from planner.api import plan_model_file
from planner.cli.main import main
from planner.cli.plan_figure_grid import device_label, mesh_position
from planner.cli.plan_figure_timeline import classify, timeline_rows
from planner.plan import Plan, Stage, save_plan
from tests.conftest import EXAMPLES, ROOT

PNG = b"\x89PNG\r\n\x1a\n"


@functools.cache
def planned(name: str) -> Plan:
    local = load_cluster("local-cpu", num_nodes=1, devices_per_node=4)
    if name == "mlp":
        return plan_model_file(EXAMPLES / "mlp.py", local, batch_size=16, method="auto")
    if name == "gpt-hash":
        return plan_model_file(EXAMPLES / "gpt.py", local, batch_size=8, method="hash")
    assert name == "gpt-pipeline"
    return plan_model_file(
        EXAMPLES / "gpt.py",
        load_cluster("p3.16xlarge", num_nodes=2),
        batch_size=32,
        method="megatron",
        degrees=(2, 2, 4),
        microbatches=4,
        schedule="1f1b",
    )


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("show")
    paths = {}
    for name in ("mlp", "gpt-hash", "gpt-pipeline"):
        paths[name] = directory / f"{name}.json"
        save_plan(planned(name), paths[name])
    return paths


def show_cli(*args: str | Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "planner", "show", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )


@pytest.mark.slow
def test_show_draws_a_png_of_a_pipelined_gpt_on_two_nodes(plans: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "plan.png"
    run = show_cli(plans["gpt-pipeline"], "--figure", out)
    assert run.returncode == 0, run.stderr
    assert out.read_bytes().startswith(PNG) and out.stat().st_size > 10_000
    assert "simulated: step" in run.stdout and f"wrote {out}" in run.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.png"]  # no temporary file left beside it


def test_show_draws_a_placement_plan(plans: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "hash.png"
    assert main(["show", str(plans["gpt-hash"]), "--figure", str(out)]) == 0
    assert out.read_bytes().startswith(PNG) and f"wrote {out}" in capsys.readouterr().out


def test_show_prints_summary_and_simulated_step(plans: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    assert main(["show", str(plans["mlp"])]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1].startswith("Megatron-LM terms: global batch 16, ")
    assert lines[2].startswith("autoplan auto plan for") and "stage 0: devices 0..3" in out
    assert "simulated: step" in out and "pipeline bubble" in out and lines[-2].startswith("next: plan run ")


def test_show_json_has_stages_and_the_simulated_step(
    plans: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "mlp.png"
    assert main(["show", str(plans["mlp"]), "--json", "--figure", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    plan = planned("mlp")
    assert {"stages", "simulated_step_time_s", "bubble_fraction", "peak_memory_bytes"} <= set(data)
    assert [stage["devices"] for stage in data["stages"]] == [list(stage.devices) for stage in plan.stages]
    assert [stage["mesh_shape"] for stage in data["stages"]] == [list(stage.mesh_shape) for stage in plan.stages]
    assert data["stages"][0]["num_operators"] == len(plan.stages[0].nodes)
    assert 0 <= data["stages"][0]["num_params_sharded"] <= data["stages"][0]["num_params"]
    assert data["simulated_step_time_s"] > 0 and 0 <= data["bubble_fraction"] < 1 and data["peak_memory_bytes"] > 0
    assert out.read_bytes().startswith(PNG)


def test_show_json_of_a_pipeline_has_a_bubble(plans: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    assert main(["show", str(plans["gpt-pipeline"]), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["stages"]) == 2 and data["num_microbatches"] == 4 and data["schedule"] == "1f1b"
    assert [len(stage["devices"]) for stage in data["stages"]] == [8, 8]
    assert 0 < data["bubble_fraction"] < 1


def _edited(plans: dict[str, Path], tmp_path: Path, **model: object) -> Path:
    data = json.loads(plans["mlp"].read_text())
    data["model"].update(model)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "does not exist"),
        ("not-json", "is not valid JSON"),
        ("no-directory", "does not exist"),
        ("not-png", "must name a .png file"),
        ("model-gone", "model file"),
    ],
)
def test_show_bad_input_is_one_line_exit_2_and_writes_nothing(
    plans: dict[str, Path], tmp_path: Path, case: str, message: str
) -> None:
    plan, figure = plans["mlp"], tmp_path / "out.png"
    if case == "missing":
        plan = tmp_path / "nowhere.json"
    elif case == "not-json":
        plan = tmp_path / "broken.json"
        plan.write_text("{not json")
    elif case == "no-directory":
        figure = tmp_path / "missing" / "out.png"
    elif case == "not-png":
        figure = tmp_path / "out.jpg"
    else:
        plan = _edited(plans, tmp_path, file=str(tmp_path / "gone.py"))
    before = sorted(tmp_path.rglob("*"))
    run = show_cli(plan, "--figure", figure)
    assert run.returncode == 2
    assert run.stderr.startswith("plan: error: ") and message in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and not run.stdout
    assert sorted(tmp_path.rglob("*")) == before


def test_show_refuses_a_plan_for_another_model(
    plans: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    figure = tmp_path / "out.png"
    assert main(["show", str(_edited(plans, tmp_path, fingerprint="0" * 16)), "--figure", str(figure)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("plan: error: model fingerprint mismatch") and error.count("\n") == 1
    assert not figure.exists()


def _stage(index: int, devices: tuple[int, ...], mesh_shape: tuple[int, ...]) -> Stage:
    return Stage(index=index, nodes=(), devices=devices, mesh_shape=mesh_shape)


def test_devices_are_labelled_with_their_stage_mesh_and_row_major_position() -> None:
    stage = _stage(1, (4, 5, 6, 7), (2, 2))
    assert [mesh_position(stage, d) for d in stage.devices] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert device_label(stage, 5) == "S1 (2,2)[0,1]"
    assert device_label(_stage(3, (2,), (1,)), 2) == "S3"


def test_spans_are_classified_by_the_lowering_task_names() -> None:
    def span(task: str, resource: str) -> Span:
        return Span(task=task, resource=resource, start_s=0.0, end_s=1.0)

    assert classify(span("F3 c0", "stage 0")) == ("forward", "F3")
    assert classify(span("B0 c2", "stage 1")) == ("backward", "B0")
    assert classify(span("step s1", "stage 1")) == ("step", "step")
    assert classify(span("F2 0>1", "link 0>1")) == ("transfer", "F2")


def test_timeline_has_a_row_per_device_and_link_or_per_stage_on_large_clusters() -> None:
    plan = planned("gpt-pipeline")
    spans = [Span(task="F0 0>1", resource="link 0>1", start_s=0.0, end_s=1.0)]
    rows, rows_of = timeline_rows(plan, spans)
    assert len(rows) == 16 + 1 and rows_of["link 0>1"] == ["link S0→S1"] and len(rows_of["stage 1"]) == 8
    wide = replace(plan, stages=(_stage(0, tuple(range(32)), (32,)), _stage(1, tuple(range(32, 64)), (32,))))
    rows, _ = timeline_rows(wide, [])
    assert rows == ["S0 (dev 0..31)", "S1 (dev 32..63)"]


def test_plan_help_lists_show(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0 and "plan show PLAN.json" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["show", "--help"])
    assert exit_info.value.code == 0 and "--figure" in capsys.readouterr().out
