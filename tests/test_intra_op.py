"""The stage ILP: golden plans, never worse than hand-written plans, identical layers solved once."""

from __future__ import annotations

import json

import pytest

from cost_models.units import GIB
from planner.costing.stage_work import explain_stage
from planner.errors import AutoplanError
from planner.intra.incumbents import data_parallel_choice, megatron_choice
from planner.intra.logical_meshes import logical_meshes
from planner.intra.problem import evaluate
from planner.intra.solve import solve_intra_op
from planner.intra.stage_problem import IntraOpOptions, build_stage_problem
from planner.intra.to_stage import stage_from_result
from tests.conftest import captured, mesh_for, setup_for
from tests.support.single_stage import single_stage_plan


def test_wide_mlp_short_of_memory_becomes_megatron() -> None:
    graph = captured("mlp", 8, "export", hidden=4096, layers=4)
    setup = setup_for(memory_gib=1.0)  # replicated weights need 2.1 GiB
    result = solve_intra_op(graph, setup, mesh_for(setup, (8,)))
    placements = stage_from_result(result).param_placements
    for block in range(4):
        assert placements[f"blocks.{block}.fc1.weight"] == ("S(0)",)  # column-parallel
        assert placements[f"blocks.{block}.fc1.bias"] == ("S(0)",)
        assert placements[f"blocks.{block}.fc2.weight"] == ("S(1)",)  # row-parallel
        assert placements[f"blocks.{block}.fc2.bias"] == ("R",)
    assert result.memory_bytes <= 1.0 * GIB


def test_small_mlp_with_large_batch_becomes_data_parallel() -> None:
    graph = captured("mlp", 65536, "export", hidden=1024, layers=2)
    setup = setup_for()
    result = solve_intra_op(graph, setup, mesh_for(setup, (8,)))
    stage = stage_from_result(result)
    assert set(stage.param_placements.values()) == {("R",)}
    matmuls = [n.name for n in graph.nodes if n.kind.value == "matmul"]
    assert all(stage.output_specs[name] == ("S(0)",) for name in matmuls)


def test_gpt_layer_on_2d_mesh_under_memory_pressure_is_data_times_tensor_parallel() -> None:
    graph = captured("gpt", 16, "export", size="tiny", hidden=1024, heads=16, layers=2, seq=256)
    setup = setup_for(memory_gib=0.3)  # pure data parallel needs 0.42 GiB here
    result = solve_intra_op(graph, setup, mesh_for(setup, (2, 4)))
    stage = stage_from_result(result)
    column = ("attn.q", "attn.k", "attn.v", "mlp.fc")
    row = ("attn.proj", "mlp.proj")
    fc = next(n for n in graph.nodes if n.module_path == "blocks.0.mlp.fc")
    layouts = []
    for tensor_axis, data_axis in ((0, 1), (1, 0)):

        def on(axis: int, name: str) -> str:
            return stage.param_placements[f"blocks.1.{name}.weight"][axis]

        megatron = all(on(tensor_axis, n) == "S(0)" for n in column) and all(on(tensor_axis, n) == "S(1)" for n in row)
        replicated = all(on(data_axis, n) == "R" for n in (*column, *row))
        batch = stage.output_specs[fc.name][data_axis] == "S(0)"
        layouts.append(megatron and replicated and batch)
    assert any(layouts), stage.param_placements


EXAMPLES = [
    ("mlp", {"hidden": 256, "layers": 3}, 64),
    ("gpt", {"size": "tiny"}, 16),
    ("resnet", {"width": 8, "blocks": 1}, 16),
    ("moe", {"hidden": 32, "experts": 4, "tokens": 16}, 16),
]


@pytest.mark.parametrize("shape", [(8,), (2, 4), (4, 2)])
@pytest.mark.parametrize(("name", "kwargs", "batch"), EXAMPLES)
def test_ilp_never_worse_than_hand_written_plans(name, kwargs, batch, shape) -> None:
    graph = captured(name, batch, "export", **kwargs)
    setup = setup_for()
    stage = build_stage_problem(graph, setup, mesh_for(setup, shape))
    result = solve_intra_op(graph, setup, mesh_for(setup, shape))
    for choice in (data_parallel_choice(stage), megatron_choice(stage)):
        objective, memory = evaluate(stage.problem, choice)
        assert memory <= setup.memory_budget_bytes  # 80 GiB holds these models however they are split
        assert result.objective_s <= objective * (1 + 1e-9)


def test_explanation_rows_add_up_to_the_objective() -> None:
    graph = captured("gpt", 8, "export", size="tiny")
    setup = setup_for()
    result = solve_intra_op(graph, setup, mesh_for(setup, (2, 4)))
    rows = explain_stage(stage_from_result(result), graph, setup)  # the plan's records, priced again
    assert [row.node for row in rows] == [node.name for node in graph.nodes]
    total = sum(row.compute_s + row.comm_s + row.step_s + row.reshard_s for row in rows)
    assert total == pytest.approx(result.objective_s, rel=1e-9)
    assert sum(row.memory_bytes for row in rows) == pytest.approx(result.memory_bytes, rel=1e-9)


def test_identical_layers_do_not_grow_the_ilp() -> None:
    setup = setup_for()
    sizes = {}
    for layers in (2, 6):
        graph = captured("gpt", 8, "export", size="tiny", layers=layers)
        stage = build_stage_problem(graph, setup, mesh_for(setup, (2, 4)))
        sizes[layers] = (len(stage.variables), len(stage.problem.edges))
    assert sizes[2][0] == sizes[6][0]
    assert max(stage.problem.node_weights) == 6


def test_no_fit_names_the_smallest_memory() -> None:
    graph = captured("mlp", 8, "export", hidden=4096, layers=4)
    setup = setup_for(memory_gib=0.01)
    with pytest.raises(AutoplanError, match=r"no sharding fits in 0\.01 GiB per device: the smallest needs 0\.2"):
        solve_intra_op(graph, setup, mesh_for(setup, (8,)))


def test_logical_meshes_keep_the_inner_axis_in_a_node() -> None:
    assert logical_meshes(8, 8) == [(8,), (4, 2), (2, 4)]
    assert logical_meshes(16, 8) == [(16,), (8, 2), (4, 4), (2, 8)]
    assert logical_meshes(6, 4) == [(6,), (3, 2)]
    assert logical_meshes(1, 8) == [(1,)]


def test_single_stage_plan_fills_placements_and_shardings() -> None:
    graph = captured("gpt", 16, "export", size="tiny")
    stages, estimate, result = single_stage_plan(graph, setup_for())
    (stage,) = stages
    assert set(stage.param_placements) == set(graph.param_names)
    assert set(stage.output_specs) == {n.name for n in graph.nodes}
    assert estimate.step_time_s == pytest.approx(result.objective_s)
    assert json.loads(json.dumps(stage.to_json()))["explanation"][0]["node"] == graph.nodes[0].name


def test_zero_shards_optimizer_state_over_data_axes() -> None:
    graph = captured("mlp", 65536, "export", hidden=1024, layers=2)
    setup = setup_for()
    plain = solve_intra_op(graph, setup, mesh_for(setup, (8,)))
    sharded = solve_intra_op(graph, setup, mesh_for(setup, (8,)), IntraOpOptions(zero=2))  # ZeRO-2
    assert set(stage_from_result(sharded).param_placements.values()) == {("R",)}  # still data parallel
    state = graph.num_params * (2 + 12)  # gradients and Adam state, mixed precision
    assert plain.memory_bytes - sharded.memory_bytes == pytest.approx(state * 7 / 8, rel=1e-6)


def test_megatron_splits_unfused_attention_by_heads() -> None:
    """Megatron's layout of attention written as separate operators (Q·Kᵀ, scale, mask, softmax, dropout, ·V): every
    one of them on the tensor axis's share of the heads, the output projection row-parallel (Megatron-LM's split)."""
    graph = captured("gpt", 8, "export", size="tiny", layers=2, attention="unfused", dropout=0.1)
    setup = setup_for()
    stage = build_stage_problem(graph, setup, mesh_for(setup, (2, 4)), IntraOpOptions(sequence_parallel=False))
    choice = megatron_choice(stage)
    variable = {node.name: stage.variable_of[stage.representative[node.name]] for node in graph.nodes}
    chosen = {name: stage.strategies[v][choice[v]] for name, v in variable.items()}
    inside = [
        node.name
        for node in graph.nodes
        if node.op_name in ("matmul", "mul", "masked_fill", "softmax", "dropout") and len(node.output.shape) == 4
    ]
    assert len(inside) == 2 * 6  # per layer: the scale (on Q), Q·Kᵀ, the mask, softmax, dropout and ·V
    for name in inside:
        assert chosen[name].output.placements[1] == "S(1)", (name, chosen[name].output)  # heads, on the tensor axis
        assert chosen[name].compute_shards == 8
    projections = [node for node in graph.nodes if node.op_name == "linear" and node.inputs[0].startswith("reshape")]
    assert projections and all(chosen[node.name].inputs[0].placements[1] == "S(2)" for node in projections)
