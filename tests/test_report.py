"""The summary in the user's words: the plan's shape, operators vs nodes, why this plan, one bubble, what next."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest

from cost_models.cluster import load_cluster
from cost_models.simulator import bubble_fraction
from planner.api import plan_model_file
from planner.cli.main import main
from planner.costing.lowering import simulate_lowered
from planner.plan import Plan, Stage
from planner.plan.report import plan_summary
from planner.plan.shape import plan_shape
from tests.conftest import EXAMPLES, pipeline
from tests.support.synthetic_plans import synthetic_plan, synthetic_stage

GPT = str(EXAMPLES / "gpt.py")
MEGATRON_ARGS = [
    "--model-arg",
    "size=tiny",
    "--cluster",
    "p3.16xlarge",
    "--devices-per-node",
    "8",
    "--batch-size",
    "8",
    "--degrees",
    "2,2,2",
    "--microbatches",
    "4",
    "--remat",
    "off",
    "--schedule",
    "1f1b",
]
BUBBLE = re.compile(r"pipeline bubble (\d+)%")


def test_shape_of_a_megatron_grid_point_in_pipeline_tensor_data_order() -> None:
    stages = [
        synthetic_stage(s, range(32 * s, 32 * s + 32), (8, 4), sharded=(1,), synced=(0,), remat=True) for s in range(2)
    ]
    plan = synthetic_plan(stages, m=16, schedule="1f1b")
    assert plan_shape(plan) == "pipeline 2 × tensor 4 × data 8, 16 microbatches, 1F1B, recompute full"


@pytest.mark.parametrize(
    ("stage", "expected"),
    [
        (synthetic_stage(0, range(8), (8,), synced=(0,)), "data 8, recompute off"),
        (synthetic_stage(0, range(8), (4, 2), sharded=(1,), synced=(0,)), "tensor 2 × data 4, recompute off"),
        (synthetic_stage(0, range(1), (1,)), "1 device, recompute off"),
        (synthetic_stage(0, range(8), (8,), sharded=(0,)), "tensor 8, recompute off"),
    ],
)
def test_shape_of_one_stage_leaves_out_degrees_of_one(stage: Stage, expected: str) -> None:
    assert plan_shape(synthetic_plan([stage])) == expected


def test_an_axis_that_splits_the_batch_and_shards_a_few_parameters_is_data_parallel() -> None:
    stage = synthetic_stage(0, range(8), (8,), sharded=(0,), synced=(0, 0))  # w sharded; two gradients synced
    assert plan_shape(synthetic_plan([stage])) == "data 8, recompute off"


def test_shape_of_uneven_stages_and_partial_recomputation() -> None:
    stages = [
        synthetic_stage(0, range(0, 2), (2,), synced=(0,), remat=True),
        synthetic_stage(1, range(2, 6), (4,), sharded=(0,)),
        synthetic_stage(2, range(6, 8), (2,), synced=(0,)),
    ]
    shape = plan_shape(synthetic_plan(stages, m=4, schedule="gpipe"))
    assert shape == "pipeline 3 stages on 2+4+2 devices, 4 microbatches, GPipe, recompute full in 1 of 3 stages"


def test_shape_of_an_operator_placement() -> None:
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=8)
    every = [synthetic_stage(d, range(d, d + 1), (1,)) for d in range(8)]
    assert plan_shape(synthetic_plan(every, m=4, schedule="dataflow", cluster=cluster, method="hash")) == (
        "operator placement over 8 devices (hash), 4 microbatches flowing"
    )
    some = plan_shape(synthetic_plan(every[:3], m=1, schedule="dataflow", cluster=cluster, method="m-etf"))
    assert some == "operator placement over 3 of 8 devices (m-etf), 1 microbatch flowing"


@functools.cache
def local_plan(method: str) -> Plan:
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=4)
    return plan_model_file(
        EXAMPLES / "mlp.py", cluster, batch_size=16, model_args={"hidden": 64, "layers": 2}, method=method, remat="off"
    )


def test_shape_of_planned_data_parallel_and_megatron() -> None:
    assert plan_shape(local_plan("data-parallel")) == "data 4, recompute off"
    megatron = plan_model_file(
        GPT,
        load_cluster("p3.16xlarge", num_nodes=1),
        batch_size=8,
        model_args={"size": "tiny"},
        method="megatron",
        degrees=(2, 2, 2),
        microbatches=4,
        remat="off",
        schedule="1f1b",
    )
    assert plan_shape(megatron) == "pipeline 2 × tensor 2 × data 2, 4 microbatches, 1F1B, recompute off"
    interleaved = plan_model_file(
        GPT,
        load_cluster("p3.16xlarge", num_nodes=1),
        batch_size=8,
        model_args={"size": "tiny"},
        method="megatron",
        degrees=(2, 2, 2),
        microbatches=4,
        remat="off",
        schedule="interleaved",
    )
    assert "interleaved 1F1B (2 virtual stages per rank)" in plan_shape(interleaved)
    assert plan_shape(interleaved).startswith("pipeline 2 ")


def test_summary_says_operators_for_graph_nodes_and_nodes_for_machines() -> None:
    plan = local_plan("data-parallel")
    lines = plan_summary(plan).splitlines()
    assert lines[0] == plan_shape(plan)
    assert "cluster local-cpu: 1 node × 4 cpu (uncalibrated rough figures: run plan calibrate, or plan tune)" in lines
    stage = next(line for line in lines if line.startswith("  stage 0:"))
    assert f"{len(plan.stages[0].nodes)} operators" in stage and "node" not in stage
    assert not any(re.search(r"\d+ nodes?\b", line) for line in lines if not line.startswith("cluster"))


def test_the_chosen_candidate_is_said_in_words() -> None:
    note = "compared under the same cost model: data-parallel 0.6 s, stage-dp 0.1 s; chosen: stage-dp"
    plan = synthetic_plan([synthetic_stage(0, range(8), (8,), synced=(0,))], notes=(note, "compute times: roofline"))
    summary = plan_summary(plan)
    assert (
        "auto chose the stage-DP candidate — pipeline stages and their submeshes from Alpa's dynamic program" in summary
    )
    assert "estimated steps of the candidates: data-parallel 0.6 s, stage-DP 0.1 s" in summary
    assert "chosen: stage-dp" not in summary and "note: compute times: roofline" in summary
    assert plan.notes[0] == note  # the plan keeps the machine-readable note


def test_next_step_of_a_cpu_plan_runs_it_here() -> None:
    lines = plan_summary(local_plan("data-parallel"), plan_path="my plans/p.json").splitlines()
    assert lines[-2].startswith("next: plan run 'my plans/p.json' --steps 10 --check-parity")
    assert lines[-1].split()[:4] == ["plan", "compile", "'my", "plans/p.json'"]


def test_next_step_of_a_multi_node_gpu_plan_compiles_and_launches_with_torchrun() -> None:
    cluster = load_cluster("p3.16xlarge", num_nodes=2)
    plan = synthetic_plan([synthetic_stage(0, range(16), (16,), synced=(0,))], cluster=cluster)
    lines = plan_summary(plan, plan_path="p.json").splitlines()
    assert lines[-2] == (
        "next: plan compile p.json --out train_dir, then on the cluster: torchrun --nnodes 2 --nproc-per-node 8 "
        "--rdzv-backend c10d --rdzv-endpoint HOST:29400 --rdzv-id JOB train_dir/train.py"
    )
    assert "run it on each of the 2 nodes" in lines[-1]


def test_the_bubble_leaves_out_the_end_of_step_in_estimate_and_simulator() -> None:
    p, m = 3, 4
    assert bubble_fraction([m * 2.0] * p, pipeline_span_s=(p + m - 1) * 2.0) == pytest.approx((p - 1) / (m + p - 1))
    simulated = simulate_lowered(pipeline([1.0] * p, [2.0] * p, m=m, schedule="1f1b", step_s=5.0))
    assert simulated.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert bubble_fraction([3.0], pipeline_span_s=3.0) == 0.0


def test_plan_show_and_compare_print_one_bubble_for_one_plan(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "megatron.json"
    assert main([GPT, *MEGATRON_ARGS, "--method", "megatron", "--out", str(out)]) == 0
    planned = BUBBLE.findall(capsys.readouterr().out)
    plan = json.loads(out.read_text())
    times, s = plan["estimate"]["per_stage_time_s"], len(plan["stages"])
    period = plan["estimate"]["breakdown_s"]["steady_s"] / 4  # the steady state's time per microbatch
    assert max(times) >= period - 1e-15  # the busiest resource or a round trip, never more than the longest stage
    expected = 1 - 4 * sum(times) / (s * (sum(times) + 3 * period))
    assert plan["estimate"]["bubble_fraction"] == pytest.approx(expected) and expected > 0.05
    assert planned == [f"{expected * 100:.0f}"]
    assert main(["show", str(out)]) == 0
    assert BUBBLE.findall(capsys.readouterr().out) == planned
    assert main(["show", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bubble_fraction"] == plan["estimate"]["bubble_fraction"]
    assert main(["compare", GPT, *MEGATRON_ARGS, "--methods", "megatron"]) == 0
    table = capsys.readouterr().out
    assert "pipeline bubble" in table and f"{planned[0]}%" in next(
        line for line in table.splitlines() if "megatron" in line
    )


def test_a_plan_from_python_prints_its_summary(capsys: pytest.CaptureFixture[str]) -> None:
    """``print(plan)`` and ``plan.summary()`` give the summary ``plan`` prints, for a plan made from Python (no model
    file), and its repr stays the dataclass's."""
    import torch

    from planner.api import plan as plan_model

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    made = plan_model(
        model, (torch.randn(8, 8),), load_cluster("local-cpu", num_nodes=1, devices_per_node=2), batch_size=8
    )
    print(made)
    printed = capsys.readouterr().out
    assert printed == made.summary() + "\n" == plan_summary(made) + "\n"
    assert printed.splitlines()[0] == plan_shape(made) and "autoplan auto plan for model:" in printed
    assert repr(made).startswith("Plan(format_version=")
