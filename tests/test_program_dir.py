"""``plan compile`` writes a directory that is the program (no process group here; ``tests/test_restart.py``
runs its launch.sh, ``tests/test_run_cli.py`` and ``tests/test_train_program.py`` its train.py).

The directory holds the model file (copied, with the files beside it that it imports), a plan naming it
relative to the directory, launch.sh and train.sbatch for the plan's nodes, compiled.json and a README whose
flags are train.py's own; a model file changed since compile, or an autoplan of another minor version, stops
the program in one line; ``plan run`` tells an edited train.py from the compiled one by its recorded sha256.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cost_models.cluster import load_cluster
from executors.training import program as program_module
from executors.training import runtime
from executors.training.program import PROGRAM_FILES, describe_program, program_to_run, write_program
from executors.training.program_readme import program_help
from executors.training.program_record import RECORD, local_imports, version_verdict
from planner.api import plan_model_file
from planner.errors import AutoplanError
from planner.plan import load_plan
from planner.plan.launch import launch_script, sbatch_script
from tests.conftest import EXAMPLES, ROOT

CPU2 = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)


def _compiled(tmp_path: Path, model: Path = EXAMPLES / "mlp.py", args: dict[str, object] | None = None) -> Path:
    args = {"hidden": 16} if args is None else args
    plan = plan_model_file(model, CPU2, batch_size=8, method="data-parallel", model_args=args)
    write_program(plan, tmp_path / "program")
    return tmp_path / "program"


def test_the_directory_holds_the_program_and_names_its_model_relative_to_itself(tmp_path: Path) -> None:
    here = _compiled(tmp_path)
    assert sorted(p.name for p in here.iterdir()) == sorted(name.rstrip("/") for name in PROGRAM_FILES)
    stored = json.loads((here / "plan.json").read_text())["model"]["file"]
    assert stored == "model/mlp.py" and (here / "model" / "mlp.py").read_text() == (EXAMPLES / "mlp.py").read_text()
    moved = tmp_path / "elsewhere"
    here.rename(moved)  # the directory is the program: moved, it still finds its model
    assert Path(load_plan(moved / "plan.json").model.file) == (moved / "model" / "mlp.py").resolve()
    record = json.loads((moved / RECORD).read_text())
    assert set(record["model_files"]) == {"model/mlp.py"} and record["autoplan"]
    assert all((moved / name).stat().st_mode & 0o111 for name in ("launch.sh", "train.sbatch"))
    assert "(as compiled)" in describe_program(load_plan(moved / "plan.json"), moved / "train.py")
    write_program(load_plan(moved / "plan.json"), moved)  # re-compiled in place: its model is its own copy
    assert json.loads((moved / RECORD).read_text())["model_files"] == record["model_files"]


def test_the_readme_lists_train_py_s_own_flags_and_what_to_install(tmp_path: Path) -> None:
    here = _compiled(tmp_path)
    readme = (here / "README.md").read_text()
    assert f"```text\n{program_help(here / 'train.py')}\n```" in readme  # its own parser's --help
    for flag in ("--auto-resume", "--checkpoint-dir", "--resume", "--steps", "--check-parity"):
        assert flag in readme, flag
    assert "autoplan 0." in readme and "pip install autoplan==" in readme and "torch >=2.4" in readme
    for command in ("plan run .", "./launch.sh", "sbatch train.sbatch", "--max-restarts"):
        assert command in readme, command


def test_a_changed_model_file_stops_the_program_and_plan_run_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    here = _compiled(tmp_path)
    with (here / "model" / "mlp.py").open("a") as file:
        file.write("\n# edited after compile\n")
    with pytest.raises(SystemExit) as stopped:
        runtime.load_plan(here / "plan.json")
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and len(err.splitlines()) == 1
    assert "mlp.py changed since `plan compile`" in err and "re-compile" in err
    with pytest.raises(AutoplanError, match=r"changed since `plan compile`"):
        program_to_run(here)


@pytest.mark.parametrize(
    "compiled,installed,runs,says",
    [
        ("0.1.0", "0.1.0", True, None),
        ("0.1.0", "0.1.4", True, "a patch apart"),
        ("0.1.0", "0.2.0", False, "pip install autoplan==0.1.0"),
        ("1.2.0", "2.2.0", False, "pip install autoplan==1.2.0"),
        ("0.1.0", None, True, "cannot tell which autoplan"),
    ],
)
def test_the_version_rule(compiled: str, installed: str | None, runs: bool, says: str | None) -> None:
    verdict = version_verdict(compiled, installed)
    assert verdict[0] is runs and (verdict[1] is None if says is None else says in verdict[1])


def test_another_minor_version_refuses_to_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    here = _compiled(tmp_path)
    record = json.loads((here / RECORD).read_text())
    major, minor, *_ = record["autoplan"].split(".")
    (here / RECORD).write_text(json.dumps({**record, "autoplan": f"{major}.{int(minor) + 1}.0"}))
    with pytest.raises(SystemExit) as stopped:
        runtime.load_plan(here / "plan.json")
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and len(err.splitlines()) == 1
    assert f"pip install autoplan=={major}.{int(minor) + 1}.0" in err


SIBLING_MODEL = """
from torch import nn

import helpers_for_compile_test as helpers
from blocks_for_compile_test.layer import Block


def build_model():
    return nn.Sequential(Block(helpers.WIDTH), nn.Linear(helpers.WIDTH, 2))


def example_inputs(batch_size):
    return (helpers.inputs(batch_size),)
"""


@pytest.mark.slow  # a python subprocess imports the copies
def test_the_files_a_model_imports_from_beside_it_are_copied_too(tmp_path: Path) -> None:
    source = tmp_path / "src"
    (source / "blocks_for_compile_test").mkdir(parents=True)
    (source / "model.py").write_text(SIBLING_MODEL)
    (source / "helpers_for_compile_test.py").write_text(
        "import torch\n\nWIDTH = 4\n\n\ndef inputs(batch_size):\n    return torch.randn(batch_size, WIDTH)\n"
    )
    (source / "blocks_for_compile_test" / "__init__.py").write_text("")
    (source / "blocks_for_compile_test" / "layer.py").write_text(
        "from torch import nn\n\n\nclass Block(nn.Linear):\n    def __init__(self, width):\n"
        "        super().__init__(width, width)\n"
    )
    (source / "unrelated.py").write_text("raise SystemExit('never imported')\n")
    found = {path.name for path in local_imports(source / "model.py")}
    assert found == {"helpers_for_compile_test.py", "blocks_for_compile_test"}
    here = _compiled(tmp_path, source / "model.py", {})
    copied = list(json.loads((here / RECORD).read_text())["model_files"])
    assert copied[0] == "model/model.py" and set(copied[1:]) == {
        "model/blocks_for_compile_test/__init__.py",
        "model/blocks_for_compile_test/layer.py",
        "model/helpers_for_compile_test.py",
    }
    assert not (here / "model" / "unrelated.py").exists()
    shutil.rmtree(source)  # the program needs only its directory: a fresh process imports the copies
    check = "from executors.training import runtime; p = runtime.load_plan('plan.json'); runtime.load_model_file(p)"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", check], cwd=here, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_newer_template_does_not_make_a_compiled_program_look_edited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = _compiled(tmp_path)
    plan = load_plan(here / "plan.json")
    monkeypatch.setattr(program_module, "TEMPLATE", program_module.TEMPLATE + "\n# a newer autoplan's template\n")
    assert "(as compiled)" in describe_program(plan, here / "train.py")  # the recorded sha256, not today's text
    (here / RECORD).unlink()
    assert "compiled by an earlier autoplan: no " in describe_program(plan, here / "train.py")


def test_launchers_for_one_node_and_for_slurm_on_two(tmp_path: Path) -> None:
    dgx = load_cluster("dgx-a100", num_nodes=2)
    single, multi, slurm = launch_script(CPU2), launch_script(dgx), sbatch_script(dgx)
    assert '--standalone --nproc-per-node 2 --max-restarts "$MAX_RESTARTS"' in single
    assert "--nnodes 2 --nproc-per-node 8" in multi and "MASTER_ADDR:?" in multi and "--rdzv-backend c10d" in multi
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8"):
        assert line in slurm, line
    assert "--gpus-per-node" not in sbatch_script(CPU2)
    for text in (single, multi, slurm):
        assert "MAX_RESTARTS=3" in text and "--max-restarts" in text
        for variable in ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_DEBUG"):
            assert variable in text
    for name, text in (("single.sh", single), ("multi.sh", multi), ("train.sbatch", slurm)):
        (tmp_path / name).write_text(text)
        checked = subprocess.run(["bash", "-n", str(tmp_path / name)], capture_output=True, text=True)
        assert checked.returncode == 0, (name, checked.stderr)
    if shutil.which("shellcheck"):
        linted = subprocess.run(["shellcheck", *map(str, tmp_path.glob("*"))], capture_output=True, text=True)
        assert linted.returncode == 0, linted.stdout
