"""The two-level search on real models: DP against brute force, golden plans, auto against hand-written plans."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from cost_models.cluster import load_cluster
from cost_models.communication import axis_groups
from planner.auto import auto_plan
from planner.baselines.handwritten import megatron_grid
from planner.errors import AutoplanError
from planner.inter.planning_input import PlanningInput
from planner.inter.pricing import price_stages
from planner.inter.search import (
    LayerTables,
    layering,
    microbatch_counts,
    option_arrays,
    search_pipeline,
)
from planner.inter.stage_dp.boundaries import boundary_table
from planner.inter.stage_dp.solver import solve_stages, submeshes
from planner.ir.capture import capture
from planner.ir.model_file import instantiate, load_model_file
from planner.ir.rebatch import MicrobatchGraphs
from planner.options import PlanOptions
from tests.conftest import EXAMPLES, captured, setup_for


def graphs_for(name: str, batch_size: int, **model_args: object) -> MicrobatchGraphs:
    model_file = load_model_file(EXAMPLES / f"{name}.py")
    model, inputs = instantiate(model_file, batch_size=batch_size, model_args=dict(model_args))
    full = captured(name, batch_size, "export", **model_args)
    return MicrobatchGraphs(
        full=full, batch_size=batch_size, capture_at=lambda b: capture(model, [x[:b] for x in inputs])
    )


def cluster_setup(name: str, nodes: int, per_node: int, memory_gib: float | None = None):
    cluster = load_cluster(name, num_nodes=nodes, devices_per_node=per_node)
    return setup_for(memory_gib, cluster=cluster)


def brute_force_step(spans, boundary, *, num_layers, nodes, per_node, m, budget) -> float:
    """Every contiguous split × every submesh per stage summing to all devices × the best fitting option."""
    meshes, total, best = submeshes(nodes, per_node), nodes * per_node, math.inf
    for count in range(1, min(num_layers, total) + 1):
        for cuts in itertools.combinations(range(1, num_layers), count - 1):
            bounds = list(zip((0, *cuts), (*cuts, num_layers), strict=True))
            for assignment in itertools.product(range(len(meshes)), repeat=count):
                if sum(meshes[j].size for j in assignment) != total:
                    continue
                times = []
                for s, ((a, b), j) in enumerate(zip(bounds, assignment, strict=True)):
                    flight = min(count - s, m)
                    fits = spans.state_bytes[a, b - 1, j] + spans.activation_bytes[a, b - 1, j] * flight <= budget
                    tau = min(
                        (t for t, ok in zip(spans.time_s[a, b - 1, j], fits, strict=True) if ok), default=math.inf
                    )
                    after = boundary(b - 1, meshes[j], meshes[assignment[s + 1]]) if s < count - 1 else 0.0
                    times.append(tau + after)
                best = min(best, math.fsum(times) + (m - 1) * max(times))
    return best


@pytest.mark.parametrize(
    ("cluster", "nodes", "per_node", "memory_gib", "m"),
    [
        ("dgx-a100", 1, 4, None, 2),
        ("p3.16xlarge", 2, 2, 0.02, 4),
        ("dgx-a100", 2, 4, 0.01, 2),
        ("p3.16xlarge", 1, 8, 0.012, 8),
    ],
)
def test_stage_dp_equals_brute_force_on_gpt(cluster: str, nodes: int, per_node: int, memory_gib, m: int) -> None:
    graph = captured("gpt", 16, "export", size="tiny", layers=4)  # 6 layers: embedding, 4 blocks, head
    setup = cluster_setup(cluster, nodes, per_node, memory_gib)
    layers = layering(graph)
    assert len(layers.layers) == 6
    tables = LayerTables(setup, PlanOptions())
    spans = option_arrays(graph, layers, tables, m).arrays
    boundary = boundary_table(graph, layers.layers, setup)
    kwargs = {"num_layers": 6, "num_nodes": nodes, "devices_per_node": per_node, "num_microbatches": m}
    expected = brute_force_step(
        spans, boundary, num_layers=6, nodes=nodes, per_node=per_node, m=m, budget=setup.memory_budget_bytes
    )
    assert math.isfinite(expected)
    plan = solve_stages(**kwargs, costs=spans, memory_budget_bytes=setup.memory_budget_bytes, boundary_s=boundary)
    assert plan.step_time_s == pytest.approx(expected, rel=1e-12)


def test_rebatched_graphs_equal_fresh_captures() -> None:
    graphs = graphs_for("gpt", 16, size="tiny", layers=2)
    graphs.at(2)  # the low capture
    for size in (4, 8):
        fresh = graphs._capture_at(size)
        assert graphs.at(size).fingerprint() == fresh.fingerprint()
        assert [n.flops_fwd for n in graphs.at(size).nodes] == [n.flops_fwd for n in fresh.nodes]


def test_microbatch_counts() -> None:
    assert microbatch_counts(12, None) == [1, 2, 4]
    assert microbatch_counts(256, None) == [1, 2, 4, 8, 16, 32, 64]
    assert microbatch_counts(12, 3) == [3]


def test_layers_are_grouped_above_the_limit() -> None:
    graph = captured("gpt", 4, "export", size="tiny", layers=6)
    grouped = layering(graph, max_layers=4)
    assert [len(names) for names in grouped.layers] == [3, 40, 40, 40, 2]
    assert grouped.kinds == (0, 1, 1, 1, 4)


def stage_groups_within_nodes(plan_stages, cluster) -> bool:
    for stage in plan_stages:
        for axis, size in enumerate(stage.mesh_shape):
            sharded = any(spec[axis].startswith("S") for spec in stage.param_placements.values())
            if size > 1 and sharded:
                for group in axis_groups(stage.devices, stage.mesh_shape, axis):
                    if len({cluster.node_of(rank) for rank in group}) > 1:
                        return False
    return True


def test_golden_too_big_for_one_device_is_split_and_keeps_tensor_groups_in_nodes() -> None:
    """The state must be split, by stages or by tensor parallelism, and tensor groups stay inside a node.
    (On p3.16xlarge's one 25 Gbit/s NIC per node, a pipeline boundary between the nodes carries the whole
    activation through it; tensor parallelism inside each node and data parallelism across them wins.)"""
    graphs = graphs_for("gpt", 16, size="tiny", layers=4, hidden=512, heads=8)
    setup = cluster_setup("p3.16xlarge", 2, 4, memory_gib=0.12)  # the model state alone needs 0.2 GiB
    state = graphs.at(16).num_params * 16
    assert state > setup.memory_budget_bytes
    result = auto_plan(PlanningInput(graphs=graphs, setup=setup, options=PlanOptions()))
    stages = result.best.stages
    sharded = any(part.startswith("S") for stage in stages for spec in stage.param_placements.values() for part in spec)
    assert len(stages) >= 2 or sharded
    assert result.best.estimate.memory_per_device_bytes <= setup.memory_budget_bytes
    assert stage_groups_within_nodes(stages, setup.cluster)


def test_golden_large_batch_stays_one_data_parallel_stage() -> None:
    graphs = graphs_for("mlp", 65536, hidden=256, layers=2)
    setup = cluster_setup("dgx-a100", 1, 8)
    result = auto_plan(PlanningInput(graphs=graphs, setup=setup, options=PlanOptions()))
    (stage,) = result.best.stages
    assert len(stage.devices) == 8
    assert all(set(spec) == {"R"} for spec in stage.param_placements.values())


@pytest.mark.parametrize(
    ("cluster", "nodes", "per_node", "memory_gib"), [("dgx-a100", 1, 4, None), ("p3.16xlarge", 2, 2, 0.05)]
)
def test_auto_is_at_most_every_exactly_priced_megatron_point(cluster, nodes, per_node, memory_gib) -> None:
    graphs = graphs_for("gpt", 16, size="tiny", layers=4)
    setup = cluster_setup(cluster, nodes, per_node, memory_gib)
    options = PlanOptions()
    result = auto_plan(PlanningInput(graphs=graphs, setup=setup, options=options))
    tables = LayerTables(setup, options)
    settings = search_pipeline(graphs, setup, tables, options=options).choices
    priced = 0
    for setting in settings:
        for candidate in megatron_grid(setting, setup):
            exact = price_stages(setting, list(candidate.specs), full_graph=graphs.at(16), tables=tables, refine=False)
            if exact is not None:
                priced += 1
                assert result.best.estimate.step_time_s <= exact.estimate.step_time_s * (1 + 1e-9), candidate.degrees
    assert priced >= 4


def test_schedule_and_remat_options_are_honoured() -> None:
    graphs = graphs_for("gpt", 16, size="tiny", layers=4)
    setup = cluster_setup("dgx-a100", 1, 4, memory_gib=0.03)
    on = auto_plan(
        PlanningInput(graphs=graphs, setup=setup, options=PlanOptions(remat="on", microbatches=4, schedule="gpipe"))
    )
    assert all(stage.remat for stage in on.best.stages)
    assert on.best.num_microbatches == 4 and on.best.schedule in ("gpipe", "none")
    off = auto_plan(PlanningInput(graphs=graphs, setup=setup, options=PlanOptions(remat="off", max_stages=1)))
    assert not any(stage.remat for stage in off.best.stages) and len(off.best.stages) == 1


def test_plan_api_writes_a_valid_multi_stage_plan() -> None:
    from planner.api import plan_model_file
    from planner.plan import Plan

    cluster = dataclasses.replace(load_cluster("p3.16xlarge", num_nodes=2, devices_per_node=2))
    result = plan_model_file(EXAMPLES / "gpt.py", cluster, batch_size=8, model_args={"size": "tiny"})
    assert Plan.from_json(result.to_json()) == result
    assert result.search.ilp_solves > 0 and result.search.dp_s > 0
    assert sum(len(stage.devices) for stage in result.stages) == 4


def test_one_f_one_b_with_fewer_microbatches_than_stages_is_planned_and_run_as_gpipe() -> None:
    """torch's 1F1B needs microbatches ≥ stages; with fewer its timeline is GPipe's, so the plan says so."""
    from planner.api import plan_model_file
    from planner.plan import PlanError, validate_plan

    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    plan = plan_model_file(
        EXAMPLES / "mlp.py",
        cluster,
        batch_size=8,
        method="megatron",
        degrees=(1, 2, 1),
        microbatches=1,
        schedule="1f1b",
    )
    assert len(plan.stages) == 2 and plan.num_microbatches == 1 and plan.schedule == "gpipe"
    graph = captured("mlp", 8, "export")
    validate_plan(plan, graph)
    with pytest.raises(PlanError, match="1f1b needs at least as many microbatches as stages"):
        validate_plan(dataclasses.replace(plan, schedule="1f1b"), graph)


@pytest.mark.parametrize("degrees", [(4, 1, 1), (2, 1, 2)])
def test_recomputation_has_one_price_in_the_estimate_and_the_simulator(degrees) -> None:
    """A one-stage plan has no boundary to overlap, so its estimate and its simulated step must agree
    exactly, recomputation included: the forward (compute, collectives, resharding) once more."""
    from planner.api import plan_model_file
    from planner.costing.lowering import simulate_plan
    from planner.costing.setup import plan_setup

    cluster = load_cluster("dgx-a100", num_nodes=1, devices_per_node=4)
    plan = plan_model_file(
        EXAMPLES / "gpt.py",
        cluster,
        batch_size=8,
        model_args={"size": "tiny"},
        method="megatron",
        degrees=degrees,
        microbatches=2,
        remat="on",
    )
    assert plan.stages[0].remat and len(plan.stages) == 1
    graph = captured("gpt", 8 // plan.num_microbatches, "export", size="tiny")
    simulated = simulate_plan(plan, graph, plan_setup(plan)).step_time_s
    assert simulated == pytest.approx(plan.estimate.step_time_s, rel=1e-9)


def test_the_simulator_charges_a_tied_weights_gradient_sync_as_the_estimate_does(monkeypatch) -> None:
    from planner.api import plan_model_file
    from planner.costing import lowering
    from planner.costing.estimate import shared_param_sync_s
    from planner.costing.setup import plan_setup

    model = EXAMPLES / "zoo" / "nn_transformer_lm.py"
    cluster = load_cluster("dgx-a100", num_nodes=1, devices_per_node=2)
    plan = plan_model_file(model, cluster, batch_size=4, method="megatron", degrees=(1, 2, 1), microbatches=1)
    module, inputs = instantiate(load_model_file(model), batch_size=4, model_args={})
    graph = capture(module, inputs)
    setup = plan_setup(plan)
    tied = shared_param_sync_s(plan.stages, graph, setup)
    assert tied > 0 and plan.estimate.breakdown_s["tied_grad_sync_s"] == pytest.approx(tied)
    charged = lowering.lower_plan(plan, graph, setup)
    with_tied = lowering.simulate_lowered(charged).step_time_s
    monkeypatch.setattr(lowering, "shared_param_sync_s", lambda *args: 0.0)
    without = lowering.lower_plan(plan, graph, setup)
    assert [a - b for a, b in zip(charged.step_s, without.step_s, strict=True)] == pytest.approx([tied, tied])
    assert with_tied - lowering.simulate_lowered(without).step_time_s == pytest.approx(tied)


def test_a_model_whose_state_alone_exceeds_every_device_is_told_to_add_devices() -> None:
    """No batch, recomputation or ZeRO level helps when weights, gradients and optimizer state split over every
    device exceed the budget: the message says how many devices would hold them, and gives no advice that cannot
    help."""
    graphs = graphs_for("gpt", 16, size="tiny", layers=4)
    setup = cluster_setup("dgx-a100", 1, 2, memory_gib=0.0005)
    with pytest.raises(AutoplanError, match=r"alone need .* use at least \d+ devices") as raised:
        auto_plan(PlanningInput(graphs=graphs, setup=setup, options=PlanOptions()))
    assert "lower the batch" not in str(raised.value) and "--zero" not in str(raised.value)
