"""DDP's gradient all-reduce overlapped with the backward pass: hand-worked timelines, and the estimate
and the simulator charging the same overlap."""

from __future__ import annotations

import pytest

from cost_models.cluster import load_cluster
from planner.api import plan_model_file
from planner.costing.lowering import lower_plan, simulate_lowered
from planner.costing.overlap import SyncSegment, ddp_segments, exposed_sync_s, grad_ready_s
from planner.costing.setup import plan_setup
from tests.conftest import EXAMPLES, captured


def test_exposed_sync_hand_worked() -> None:
    # buckets ready at 1 s and 3 s of a 4 s backward; all-reduces of 1.5 s and 2 s:
    # the first runs 1-2.5, the second 3-5: the step waits 1 s past the backward's end
    segments = [
        SyncSegment(backward_s=1, all_reduce_s=1.5),
        SyncSegment(backward_s=2, all_reduce_s=2),
        SyncSegment(backward_s=1, all_reduce_s=0),
    ]
    assert exposed_sync_s(segments) == pytest.approx(1.0)
    # a slow first bucket delays the second: 1-4, then 4-6, 2 s past
    slow = [
        SyncSegment(backward_s=1, all_reduce_s=3),
        SyncSegment(backward_s=2, all_reduce_s=2),
        SyncSegment(backward_s=1, all_reduce_s=0),
    ]
    assert exposed_sync_s(slow) == pytest.approx(2.0)
    # everything hidden
    assert exposed_sync_s([SyncSegment(backward_s=1, all_reduce_s=0.5), SyncSegment(backward_s=3, all_reduce_s=0)]) == 0


def test_gradients_are_ready_after_their_first_readers_backward() -> None:
    graph = captured("mlp", 8, "export", hidden=64, layers=2)
    backward = {node.name: 1.0 for node in graph.nodes}
    ready = grad_ready_s(graph, backward)
    last_block = [name for name in graph.param_names if name.startswith("blocks.1.")]
    first_block = [name for name in graph.param_names if name.startswith("blocks.0.")]
    assert max(ready[name] for name in last_block) < min(ready[name] for name in first_block)
    assert max(ready.values()) <= len(graph.nodes)


def test_segments_cover_the_backward_and_every_bucket() -> None:
    graph = captured("mlp", 8, "export", hidden=2048, layers=4)  # 4 x 16 MiB fp32 weights
    cluster = load_cluster("dgx-a100")
    backward = {node.name: 1e-3 for node in graph.nodes}
    segments = ddp_segments(graph, backward, optimizer="sgd", num_devices=8, link=cluster.intra_node)
    assert sum(segment.backward_s for segment in segments) == pytest.approx(1e-3 * len(graph.nodes))
    assert len([segment for segment in segments if segment.all_reduce_s > 0]) >= 3  # 1 MiB, then 25 MiB buckets


@pytest.mark.parametrize(
    ("example", "args", "cluster", "nodes"),
    [
        ("mlp", {"hidden": 1024, "layers": 4}, "dgx-a100", 1),
        ("gpt", {"size": "tiny"}, "p3.16xlarge", 1),
        ("resnet", {}, "p3.16xlarge", 2),
    ],
)
def test_data_parallel_estimate_and_simulator_overlap_alike(example, args, cluster, nodes) -> None:
    plan = plan_model_file(
        EXAMPLES / f"{example}.py",
        load_cluster(cluster, num_nodes=nodes),
        batch_size=64,
        model_args=args,
        method="data-parallel",
        zero="0",
        microbatches=1,
    )
    graph = captured(example, 64, "export", **args)
    lowered = lower_plan(plan, graph, plan_setup(plan))
    assert lowered.sync_segments, "a plan run as DDP has its buckets in the last backward"
    simulated = simulate_lowered(lowered).step_time_s
    assert simulated == pytest.approx(plan.estimate.step_time_s, rel=2e-3)
    breakdown = plan.estimate.breakdown_s
    whole = breakdown["grad_sync_s"] + plan.estimate.hidden_s["grad_sync_overlapped_s"]
    assert 0 <= breakdown["grad_sync_s"] <= whole


def test_overlap_hides_sync_behind_a_long_backward() -> None:
    """32 layers of 2 MiB gradients: DDP's buckets go out while the earlier layers' backward runs, and only
    the last bucket (ready when the backward ends) is left to wait for."""
    plan = plan_model_file(
        EXAMPLES / "mlp.py",
        load_cluster("dgx-a100"),
        batch_size=4096,
        model_args={"hidden": 1024, "layers": 32},
        method="data-parallel",
        zero="0",
        microbatches=1,
    )
    exposed, hidden = plan.estimate.breakdown_s["grad_sync_s"], plan.estimate.hidden_s["grad_sync_overlapped_s"]
    assert hidden > 0.5 * (exposed + hidden)


def test_a_searched_one_stage_ddp_plan_is_priced_as_the_simulator_runs_it() -> None:
    plan = plan_model_file(EXAMPLES / "resnet.py", load_cluster("p3.16xlarge"), batch_size=256, method="auto")
    assert len(plan.stages) == 1 and all(set(spec) == {"R"} for spec in plan.stages[0].param_placements.values())
    graph = captured("resnet", 256 // plan.num_microbatches, "export")
    simulated = simulate_lowered(lower_plan(plan, graph, plan_setup(plan))).step_time_s
    assert simulated == pytest.approx(plan.estimate.step_time_s, rel=1e-6)


def test_a_recomputing_ddp_plan_pays_its_forward_twice_in_the_estimate_and_the_simulator() -> None:
    plan = plan_model_file(
        EXAMPLES / "gpt.py",
        load_cluster("dgx-a100"),
        batch_size=16,
        model_args={"size": "tiny"},
        method="megatron",
        degrees=(1, 1, 8),
        microbatches=2,
        remat="on",
    )
    assert plan.stages[0].remat and all(set(spec) == {"R"} for spec in plan.stages[0].param_placements.values())
    graph = captured("gpt", 8, "export", size="tiny")
    lowered = lower_plan(plan, graph, plan_setup(plan))
    forward = sum(chunk.fwd_s for chunk in lowered.chunks)
    assert plan.estimate.step_time_s >= 2 * (2 * forward + sum(c.bwd_s - c.fwd_s for c in lowered.chunks)) - 1e-12
    assert simulate_lowered(lowered).step_time_s == pytest.approx(plan.estimate.step_time_s, rel=1e-6)


def test_the_plan_says_where_its_gradient_sync_overlaps() -> None:
    cluster = load_cluster("dgx-a100")
    ddp = plan_model_file(EXAMPLES / "mlp.py", cluster, batch_size=64, method="data-parallel", zero="0")
    sharded = plan_model_file(EXAMPLES / "mlp.py", cluster, batch_size=64, method="megatron", degrees=(8, 1, 1))
    assert any("overlapped with the last backward" in note for note in ddp.notes)
    assert any("in buckets, overlapped with its last backward" in note for note in sharded.notes)
