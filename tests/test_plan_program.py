"""The plan is the program: every node's stored strategy is what the simulator prices and the executors run.

No process group here (the executors' side is in ``tests/test_executors.py``: an edited plan runs,
matches one device and issues the collectives its records list; ``tests/test_rank_imports.py``: a
rank reads the plan without the search).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cost_models.cluster import load_cluster
from planner.api import plan_model_file
from planner.cli.main import main
from planner.costing.lowering import simulate_plan
from planner.costing.node_cost import grad_values
from planner.costing.records import record_of, strategy_of
from planner.costing.setup import plan_setup
from planner.costing.stage_work import check_plan_strategies, stage_node_work
from planner.plan import FORMAT_VERSION, NodeSharding, Plan, PlanError, save_plan
from planner.sharding.op_rules import enumerate_strategies
from planner.sharding.specs import StageMesh
from planner.sharding.strategies import StrategyContext
from tests.conftest import EXAMPLES, captured, edit_strategy
from tests.support.charged_collectives import charged_collectives

MODELS = {
    "mlp": ({}, 16),
    "gpt": ({"size": "tiny"}, 8),
    "moe": ({"hidden": 32, "layers": 2, "experts": 4, "ffn": 32, "tokens": 8}, 8),
    "resnet": ({"width": 8, "blocks": 1, "stages": 2, "image_size": 8}, 8),
}


@pytest.mark.filterwarnings("ignore:no sharding rule")
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_strategy_round_trips_through_its_record(model: str, mesh_shape: tuple[int, ...]) -> None:
    """What the plan stores of a strategy is all of it: read back, it is priced to the same bit."""
    args, batch = MODELS[model]
    graph = captured(model, batch, **args)
    cluster = load_cluster("dgx-a100")  # mixed precision: 2-byte gradients and activations
    mesh = StageMesh(
        cluster=cluster, devices=tuple(range(len(mesh_shape) * 2)), mesh_shape=mesh_shape, activation_itemsize=2
    )
    context = StrategyContext(graph=graph, mesh=mesh, grad_values=grad_values(graph), grad_itemsize=2)
    count = 0
    for node in graph.nodes:
        for strategy in enumerate_strategies(node, context)[0]:
            record = record_of(node, strategy)
            assert NodeSharding.from_json(json.loads(json.dumps(record.to_json()))) == record
            assert strategy_of(node, record, context) == strategy, (node.name, strategy.name)
            count += 1
    assert count > 2 * len(graph.nodes)  # splits were tried, not only the replicated strategy


def _megatron(degrees: tuple[int, int, int], model: str = "mlp") -> tuple[Plan, object]:
    args, batch = MODELS[model]
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=degrees[0] * degrees[1] * degrees[2])
    plan = plan_model_file(
        EXAMPLES / f"{model}.py", cluster, batch_size=batch, model_args=args, method="megatron", degrees=degrees
    )
    return plan, captured(model, batch // plan.num_microbatches, **args)


def test_a_plans_json_has_every_nodes_input_specs_and_collectives() -> None:
    plan, graph = _megatron((2, 1, 2), "gpt")
    data = json.loads(plan.dumps())
    assert data["format_version"] == FORMAT_VERSION == 3
    phases = set()
    for stage in data["stages"]:
        assert set(stage["strategies"]) == set(stage["nodes"])
        for name, record in stage["strategies"].items():
            node = graph.node(name)
            assert len(record["input_specs"]) == len(node.inputs)
            assert all(spec is None or len(spec) == len(stage["mesh_shape"]) for spec in record["input_specs"])
            assert len(record["output_spec"]) == len(stage["mesh_shape"]) and record["compute_shards"] >= 1
            phases |= {collective["phase"] for collective in record["collectives"]}
    assert phases == {"forward", "backward", "sync"}  # tensor and data parallel on a 2-D mesh


def test_the_simulator_prices_an_edited_strategy_as_stored() -> None:
    """gelu follows linear's column split; stored as replicated instead, its input is all-gathered, linear_1
    slices it again (its gradient all-gathered backward) and gelu computes unsplit: the simulator charges
    exactly that and nothing else changes."""
    plan, graph = _megatron((2, 1, 1))
    assert plan.stages[0].strategies["gelu"].output_spec == ("S(1)",)
    edited = edit_strategy(plan, graph, stage=0, node="gelu", output_spec=("R",))
    setup = plan_setup(plan)
    check_plan_strategies(edited, graph)  # one the sharding rules produce
    before = stage_node_work(plan.stages[0], graph, setup)
    after = stage_node_work(edited.stages[0], graph, setup)
    assert before["gelu"].reshard_s == 0 < after["gelu"].reshard_s
    assert before["linear_1"].reshard_s == 0 < after["linear_1"].reshard_s
    assert after["gelu"].compute_s > before["gelu"].compute_s
    assert {n: w for n, w in after.items() if n not in ("gelu", "linear_1")} == {
        n: w for n, w in before.items() if n not in ("gelu", "linear_1")
    }
    charged = [charged_collectives(p.stages[0], graph, setup, num_microbatches=1) for p in (plan, edited)]
    assert charged[1]["forward"] - charged[0]["forward"] == {"all_gather": 1}
    assert charged[1]["backward"] - charged[0]["backward"] == {"all_gather": 1}
    assert charged[1]["sync"] == charged[0]["sync"]
    steps = [simulate_plan(p, graph, setup).step_time_s for p in (plan, edited)]
    assert steps[1] > steps[0]


def test_the_explanation_is_the_priced_records() -> None:
    plan, graph = _megatron((2, 1, 1))
    work = stage_node_work(plan.stages[0], graph, plan_setup(plan))
    for row in plan.stages[0].explanation:
        assert row.compute_s == work[row.node].compute_s and row.reshard_s == work[row.node].reshard_s


def test_a_strategy_no_rule_produces_is_refused_at_show_run_and_compile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan, graph = _megatron((2, 1, 1))
    stage = plan.stages[0]
    bad = dataclasses.replace(stage.strategies["gelu"], compute_shards=1)  # split output, unsplit compute
    edited = dataclasses.replace(
        plan, stages=(dataclasses.replace(stage, strategies={**stage.strategies, "gelu": bad}),)
    )
    with pytest.raises(PlanError, match=r"node gelu .* no sharding rule produces on mesh"):
        check_plan_strategies(edited, graph)
    path = tmp_path / "edited.json"
    save_plan(edited, path)
    for command in (
        ["show", str(path)],
        ["compile", str(path), "--out", str(tmp_path / "out")],
        ["run", str(path), "--steps", "1"],
    ):
        assert main(command) == 2, command
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "no sharding rule produces" in err[0] and "re-plan" in err[0], err
    assert not (tmp_path / "out" / "train.py").exists()


@pytest.mark.parametrize("version", [1, 2])
def test_an_older_plan_is_refused_with_one_line_that_says_to_replan(
    version: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan, _ = _megatron((2, 1, 1))
    data = plan.to_json()
    data["format_version"] = version
    for stage in data["stages"]:
        if version == 1:  # output specs only
            stage["node_shardings"] = {name: record["output_spec"] for name, record in stage.pop("strategies").items()}
        else:  # savings as free-form objects, {} for none
            stage["memory_saving"] = stage["sequence_parallel_saving"] = {}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    for command in (["show", str(path)], ["run", str(path)], ["compile", str(path), "--out", str(tmp_path / "o")]):
        assert main(command) == 2, command
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"format_version {version}" in err[0] and "re-plan" in err[0], err
