"""Plan JSON round-trip and every validation error, naming the offending values."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cost_models.cluster import load_cluster
from planner.api import plan
from planner.ir.model_file import instantiate, load_model_file
from planner.plan import FORMAT_VERSION, Plan, PlanError, Stage, load_plan, save_plan, validate_plan
from tests.conftest import EXAMPLES, captured

ARGS = {"hidden": 64, "layers": 2}


@pytest.fixture(scope="module")
def mlp_plan() -> Plan:
    model_file = load_model_file(EXAMPLES / "mlp.py")
    model, inputs = instantiate(model_file, batch_size=8, model_args=ARGS)
    return plan(
        model,
        inputs,
        load_cluster("dgx-a100"),
        batch_size=8,
        method="data-parallel",  # one stage over every device, every parameter replicated
        model_ref={"file": str(EXAMPLES / "mlp.py"), "args": ARGS},
    )


def with_stage(p: Plan, **changes: object) -> Plan:
    return dataclasses.replace(p, stages=(dataclasses.replace(p.stages[0], **changes),))


def test_json_round_trip(mlp_plan: Plan, tmp_path) -> None:
    text = mlp_plan.dumps()
    data = json.loads(text)
    assert data["format_version"] == FORMAT_VERSION
    for key in ("method", "batch_size", "num_microbatches", "schedule", "stages", "estimate", "search"):
        assert key in data
    stage = data["stages"][0]
    assert set(stage) >= {"devices", "mesh_shape", "param_placements", "strategies"}
    assert stage["param_placements"]["blocks.0.fc1.weight"] == ["R"]
    assert set(data["estimate"]) >= {"step_time_s", "memory_per_device_bytes", "tflops_per_device", "bubble_fraction"}
    assert "time_s" in data["search"]
    assert Plan.from_json(data) == mlp_plan
    save_plan(mlp_plan, tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json") == mlp_plan


def test_plan_is_frozen(mlp_plan: Plan) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        mlp_plan.batch_size = 3  # type: ignore[misc]


def test_valid_plan_validates(mlp_plan: Plan) -> None:
    validate_plan(mlp_plan, captured("mlp", 8, "export", **ARGS))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: with_stage(p, nodes=p.stages[0].nodes[1:]), r"node \w+ is not placed in any stage"),
        (lambda p: with_stage(p, nodes=(*p.stages[0].nodes, p.stages[0].nodes[0])), "is placed twice"),
        (lambda p: with_stage(p, nodes=(*p.stages[0].nodes, "ghost")), "node ghost is not in the model"),
        (
            lambda p: with_stage(
                p, param_placements={k: v for k, v in p.stages[0].param_placements.items() if "fc2" not in k}
            ),
            r"parameter blocks\.\d\.fc2\.\w+ is not placed",
        ),
        (lambda p: with_stage(p, devices=(0, 1, 2, 3, 4, 5, 6, 6)), "device 6 is used by stage 0 and stage 0"),
        (lambda p: with_stage(p, devices=(0, 1, 2, 3, 4, 5, 6, 99)), "device 99 is not in the cluster"),
        (lambda p: with_stage(p, mesh_shape=(3,)), r"mesh shape \[3\] does not hold its 8 devices"),
        (
            lambda p: with_stage(p, param_placements={**p.stages[0].param_placements, "blocks.0.fc1.weight": ("Q",)}),
            "placement 'Q' is not one of",
        ),
        (
            lambda p: with_stage(p, param_placements={**p.stages[0].param_placements, "blocks.0.fc1.bias": ("S(1)",)}),
            r"parameter blocks\.0\.fc1\.bias placement S\(1\) names dim 1 of a 1-d tensor",
        ),
        (
            lambda p: with_stage(p, param_placements={**p.stages[0].param_placements, "blocks.0.fc1.bias": ("R", "R")}),
            "has 2 placements",
        ),
        (lambda p: dataclasses.replace(p, schedule="zigzag"), "schedule 'zigzag'"),
        (lambda p: dataclasses.replace(p, num_microbatches=3), "batch size 8 cannot be split into 3"),
        (lambda p: dataclasses.replace(p, model=dataclasses.replace(p.model, fingerprint="abc")), "made for model abc"),
    ],
)
def test_each_validation_error_names_the_values(mlp_plan: Plan, change, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        validate_plan(change(mlp_plan), captured("mlp", 8, "export", **ARGS))


def test_indivisible_shard_is_named(mlp_plan: Plan) -> None:
    graph = captured("mlp", 8, "export", **ARGS)
    stage = Stage(
        index=0,
        nodes=mlp_plan.stages[0].nodes,
        devices=(0, 1, 2),
        mesh_shape=(3,),
        strategies={},
        param_placements={name: ("S(0)",) for name in graph.param_names},
    )
    with pytest.raises(PlanError, match="of size 64 cannot be split into 3 shards"):
        validate_plan(dataclasses.replace(mlp_plan, stages=(stage,)), graph)


def test_wrong_format_version_and_malformed_json(mlp_plan: Plan) -> None:
    data = mlp_plan.to_json()
    with pytest.raises(PlanError, match="format_version 99"):
        Plan.from_json({**data, "format_version": 99})
    del data["stages"]
    with pytest.raises(PlanError, match="malformed"):
        Plan.from_json(data)
