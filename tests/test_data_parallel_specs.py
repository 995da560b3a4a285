"""The data-parallel stage's node specs follow the batch and are ones a sharding strategy produces."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from cost_models.cluster import load_cluster
from cost_models.compute import RooflineCompute
from planner.api import plan_prepared, prepare_model_file
from planner.baselines.data_parallel import data_parallel_stage
from planner.costing.estimate import batched_values
from planner.costing.setup import CostSetup
from planner.costing.stage_work import stage_node_work
from planner.errors import AutoplanError
from planner.ir.capture import capture
from planner.ir.graph import OpGraph
from planner.plan import Stage
from tests.conftest import EXAMPLES, captured

MOE_ARGS = {"hidden": 32, "layers": 2, "experts": 4, "ffn": 32, "tokens": 8}
EXAMPLE_ARGS = {
    "mlp": {},
    "gpt": {},
    "resnet": {"width": 8, "blocks": 1, "stages": 2, "image_size": 8},
    "moe": MOE_ARGS,
}


@functools.cache
def setup_for(devices: int) -> CostSetup:
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=devices)
    return CostSetup(cluster=cluster, compute=RooflineCompute(device=cluster.device), optimizer="adam-mixed")


def stage_of(graph: OpGraph, devices: int, batch_size: int = 8) -> Stage:
    return data_parallel_stage(graph, setup_for(devices), batch_size=batch_size, devices=tuple(range(devices)))


def test_moe_einsums_split_the_batch_where_it_is() -> None:
    graph = captured("moe", 8, **MOE_ARGS)
    stage = stage_of(graph, 2)
    specs = stage.output_specs
    # "nd,edf->enf" and "enf,efd->end" carry the tokens (n) on dim 1; "end,ne->nd" back on dim 0
    for first, second, combine in (("einsum", "einsum_1", "einsum_2"), ("einsum_3", "einsum_4", "einsum_5")):
        assert specs[first] == specs[second] == ("S(1)",)
        assert specs[combine] == ("S(0)",)
    assert set(stage.param_placements.values()) == {("R",)}
    work = stage_node_work(stage, graph, setup_for(2))
    assert all(w.reshard_s == 0.0 for w in work.values())
    assert work["einsum"].comm_s == 0.0  # the batch split: no collectives, only the gradient sync


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("example", sorted(EXAMPLE_ARGS))
def test_stage_work_accepts_the_data_parallel_plan(example: str, devices: int) -> None:
    graph = captured(example, 8, **EXAMPLE_ARGS[example])
    stage = stage_of(graph, devices)
    batched = batched_values(graph)
    assert all(stage.output_specs[name] != ("R",) for name in stage.nodes if name in batched)
    assert set(stage.param_placements.values()) == {("R",)}
    work = stage_node_work(stage, graph, setup_for(devices))
    assert set(work) == set(stage.nodes)


def test_batch_that_does_not_divide_is_a_clear_error() -> None:
    with pytest.raises(AutoplanError, match="cannot be split evenly over 4 data-parallel devices"):
        stage_of(captured("mlp", 6), 4, batch_size=6)


class _BatchMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        centre = h.mean(0) * 2  # the batch is reduced away: replicated, never re-split
        return (h - centre) * (centre + 1)


class _FusedSplit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(16, dim=-1)  # no sharding rule: replicated
        return self.out(q * k + v) + x


def test_a_reduced_batch_stays_replicated_and_its_consumers_split() -> None:
    graph = capture(_BatchMean(), (torch.randn(8, 16),))
    stage = stage_of(graph, 2)
    specs = stage.output_specs
    assert specs["linear"] == specs["sub"] == specs["mul_1"] == ("S(0)",)
    assert specs["mean"] == specs["mul"] == specs["add"] == ("R",)
    stage_node_work(stage, graph, setup_for(2))


@pytest.mark.filterwarnings("ignore:no sharding rule")
def test_an_unruled_operator_does_not_replicate_the_rest() -> None:
    graph = capture(_FusedSplit(), (torch.randn(8, 4, 16),))
    stage = stage_of(graph, 2)
    replicated = [name for name, spec in stage.output_specs.items() if spec == ("R",)]
    assert [graph.node(name).target for name in replicated] == ["aten.split.Tensor"]
    stage_node_work(stage, graph, setup_for(2))


def test_auto_plans_moe() -> None:
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    prepared = prepare_model_file(EXAMPLES / "moe.py", cluster, batch_size=8, model_args=MOE_ARGS)
    for method in ("auto", "data-parallel"):
        plan = plan_prepared(prepared, method)
        assert plan.estimate.step_time_s > 0
    assert plan.stages[0].output_specs["einsum"] == ("S(1)",)
