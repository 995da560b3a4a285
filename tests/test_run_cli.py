"""``plan run`` and ``plan compile`` end to end: output, parity verdicts, bad input, a killed rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cost_models.cluster import load_cluster
from executors.training.launch import torchrun_argv
from planner.api import plan_model_file
from planner.plan import save_plan

pytestmark = pytest.mark.slow  # every test here launches processes

ROOT = Path(__file__).resolve().parent.parent
NOISY_MODEL = """
import torch
from torch import nn

class Noisy(nn.Module):  # multiplicative noise drawn in place: parity fixes dropout and rand, not uniform_
    def forward(self, x):
        return x * torch.empty_like(x).uniform_(0.5, 1.5)

def build_model():
    return nn.Sequential(nn.Linear(8, 8), Noisy(), nn.Linear(8, 4))

def example_inputs(batch_size):
    return (torch.randn(batch_size, 8),)
"""


def plan_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "planner", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


@pytest.fixture(scope="module")
def mlp_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("run") / "mlp.json"
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    save_plan(plan_model_file(ROOT / "examples" / "mlp.py", cluster, batch_size=16, method="megatron"), path)
    return path


def test_run_prints_each_step_and_parity(mlp_plan: Path) -> None:
    done = plan_cli("run", str(mlp_plan), "--steps", "2", "--check-parity")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 2
    assert all("loss" in line and "ms" in line and "parity match" in line for line in lines)


def test_compiled_program_runs_under_torchrun(mlp_plan: Path, tmp_path: Path) -> None:
    out = tmp_path / "program"
    done = plan_cli("compile", str(mlp_plan), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert (out / "train.py").is_file() and json.loads((out / "plan.json").read_text())["method"] == "megatron"
    assert "torchrun --standalone --nproc-per-node 2" in (out / "train.py").read_text()
    assert f"launch: torchrun --standalone --nproc-per-node 2 {out / 'train.py'}" in done.stdout
    command = torchrun_argv(world=2, program=out / "train.py", args=["--steps", "1", "--check-parity"])
    run = subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "parity match" in run.stdout
    program = out / "train.py"  # edited as a user edits it: `plan run DIR` runs the edit, and says so
    marker = 'def make_dataloader(rank_info):\n    print("my data loader", flush=True)\n'
    program.write_text(program.read_text().replace("def make_dataloader(rank_info):\n", marker))
    edited = plan_cli("run", str(out), "--steps", "1", "--check-parity")
    assert edited.returncode == 0, edited.stderr[-2000:]
    assert f"plan run: program: {program} (edited since `plan compile`" in edited.stdout
    assert "my data loader" in edited.stdout and "parity match" in edited.stdout


def test_parity_mismatch_exits_non_zero(tmp_path: Path) -> None:
    model = tmp_path / "noisy.py"
    model.write_text(NOISY_MODEL)
    plan = tmp_path / "noisy.json"
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    save_plan(plan_model_file(model, cluster, batch_size=8, method="data-parallel"), plan)
    done = plan_cli("run", str(plan), "--steps", "1", "--check-parity")
    assert done.returncode == 1
    assert "parity MISMATCH" in done.stdout and "largest gradient diff" in done.stdout


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda data: data["model"].update(fingerprint="0123456789abcdef"), "fingerprint mismatch"),
        (lambda data: data.update(format_version=99), "format_version"),
    ],
)
def test_bad_plan_is_one_line_and_exit_2(mlp_plan: Path, tmp_path: Path, mutate, message: str) -> None:
    data = json.loads(mlp_plan.read_text())
    mutate(data)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    done = plan_cli("run", str(bad))
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args,message", [(["--steps", "0"], "--steps"), (["--lr", "-1"], "--lr")])
def test_bad_options_exit_2(mlp_plan: Path, args: list[str], message: str) -> None:
    done = plan_cli("run", str(mlp_plan), *args)
    assert done.returncode == 2 and message in done.stderr


def test_missing_plan_exit_2(tmp_path: Path) -> None:
    done = plan_cli("run", str(tmp_path / "none.json"))
    assert done.returncode == 2 and "does not exist" in done.stderr


def test_killed_rank_stops_every_rank_within_60_s(mlp_plan: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "planner", "run", str(mlp_plan), "--steps", "100000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        for line in process.stdout:
            if line.startswith("step 3 "):
                break
        ranks = _rank_processes(process.pid)
        assert set(ranks) == {0, 1}, ranks
        os.kill(ranks[1], signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = process.communicate(timeout=60)
        assert time.monotonic() - killed_at < 60
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode != 0
    assert "rank 1 failed" in stderr and "SIGKILL" in stderr
    assert all(not _alive(pid) for pid in ranks.values())


def _rank_processes(root: int) -> dict[int, int]:
    """RANK -> pid of the descendants of ``root`` that torchrun started."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if f"TORCHELASTIC_RUN_ID=autoplan-{root}".encode() not in environ:
            continue
        ranks = [item for item in environ if item.startswith(b"RANK=")]
        if ranks and "python" in stat:
            found[int(ranks[0][5:])] = int(entry.name)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"
