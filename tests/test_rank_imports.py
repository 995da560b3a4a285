"""A rank of ``plan run`` reads the plan; it does not load the search (nor highspy, pulp or rich)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from cost_models.cluster import load_cluster
from executors.training.launch import torchrun_argv
from executors.training.program import write_program
from planner.api import plan_model_file
from tests.conftest import EXAMPLES, ROOT

pytestmark = pytest.mark.slow  # every test here launches processes

SEARCH = (
    "planner.api",
    "planner.auto",
    "planner.compare",
    "planner.intra",
    "planner.inter",
    "planner.baselines",
    "planner.cli",
    "highspy",
    "pulp",
    "rich",
)


def test_a_rank_of_plan_run_imports_no_search_module(tmp_path: Path) -> None:
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    plan = plan_model_file(EXAMPLES / "mlp.py", cluster, batch_size=16, method="megatron", degrees=(2, 1, 1))
    program = write_program(plan, tmp_path / "program")  # what `plan run` launches on every rank
    worker = ROOT / "tests" / "rank_modules_worker.py"
    command = torchrun_argv(world=2, program=worker, args=[tmp_path, program, "--steps", "1"])
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(2):
        modules = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "executors.parallel.tensor_parallel" in modules and "planner.plan" in modules  # it did run the plan
        loaded = [m for m in modules if any(m == name or m.startswith(name + ".") for name in SEARCH)]
        assert not loaded, f"rank {rank} imported {loaded}"
