"""A plan finds its model file from wherever it is run: stored absolute, or (older plans) relative to
the plan file or the current directory; a moved file is one clear line."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest

from cost_models.cluster import load_cluster
from planner.api import plan_model_file
from planner.cli.main import main
from planner.plan import Plan, PlanError, load_plan, save_plan
from tests.conftest import EXAMPLES, ROOT

SMALL = {"hidden": 64, "layers": 2}


@functools.cache
def _planned() -> Plan:
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    return plan_model_file(EXAMPLES / "mlp.py", cluster, batch_size=8, method="data-parallel", model_args=SMALL)


def _older_plan(path: Path, model_file: str) -> Path:
    """A plan file as plans were written before model paths were stored absolute."""
    data = _planned().to_json()
    data["model"]["file"] = model_file
    path.write_text(json.dumps(data))
    return path


def test_planning_stores_the_absolute_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(ROOT)
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    made = plan_model_file("examples/mlp.py", cluster, batch_size=8, method="data-parallel", model_args=SMALL)
    assert made.model.file == str(EXAMPLES / "mlp.py")
    save_plan(made, tmp_path / "p.json")
    monkeypatch.chdir(tmp_path)
    assert load_plan(tmp_path / "p.json").model.file == str(EXAMPLES / "mlp.py")


def test_relative_path_beside_the_plan(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(EXAMPLES / "mlp.py", project / "mlp.py")
    _older_plan(project / "plan.json", "mlp.py")
    monkeypatch.chdir(tmp_path)
    assert load_plan("project/plan.json").model.file == str((project / "mlp.py").resolve())


def test_relative_path_from_the_current_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    plan = _older_plan(tmp_path / "plan.json", "examples/mlp.py")
    monkeypatch.chdir(ROOT)
    assert load_plan(plan).model.file == str(EXAMPLES / "mlp.py")


def test_the_plan_file_folder_comes_first(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "examples").mkdir()
    shutil.copy(EXAMPLES / "mlp.py", tmp_path / "examples" / "mlp.py")
    plan = _older_plan(tmp_path / "plan.json", "examples/mlp.py")
    monkeypatch.chdir(ROOT)  # has an examples/mlp.py too
    assert load_plan(plan).model.file == str((tmp_path / "examples" / "mlp.py").resolve())


def test_a_plan_made_from_python_has_no_file_to_find(tmp_path: Path) -> None:
    data = _planned().to_json()
    data["model"]["file"] = None
    (tmp_path / "p.json").write_text(json.dumps(data))
    assert load_plan(tmp_path / "p.json").model.file is None


def test_moved_relative_model_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    plan = _older_plan(tmp_path / "plan.json", "examples/mlp.py")
    elsewhere = (tmp_path / "elsewhere").resolve()
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(PlanError) as error:
        load_plan(plan)
    assert str(error.value) == (
        f"model file examples/mlp.py of plan {plan} not found (looked in {tmp_path.resolve()} and {elsewhere}): "
        "it moved? "
        're-plan, or edit "model.file" in the plan'
    )


def test_plan_show_of_a_moved_model_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = tmp_path / "mlp.py"
    shutil.copy(EXAMPLES / "mlp.py", model)
    plan = _older_plan(tmp_path / "plan.json", str(model))
    model.unlink()
    assert main(["show", str(plan)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines() == [
        f'plan: error: model file {model} of plan {plan} not found: it moved? re-plan, or edit "model.file" in the plan'
    ]
