"""Roofline node times and the data-parallel estimate, against hand-worked values."""

from __future__ import annotations

import dataclasses

import pytest

from cost_models.cluster import DeviceSpec, load_cluster
from cost_models.communication import all_reduce_s, ddp_buckets
from cost_models.compute import NodeTime, RooflineCompute
from cost_models.memory import model_state_bytes
from planner.costing.estimate import compute_s, data_parallel_estimate
from planner.costing.setup import CostSetup
from planner.ir.graph import NodeKind, OpNode, TensorMeta
from tests.conftest import captured

DEVICE = DeviceSpec(
    name="toy",
    peak_flops={"float32": 1e12},
    memory_bytes=10**10,
    memory_bandwidth=1e11,
    compute_efficiency=0.5,
    memory_efficiency=0.5,
    kernel_overhead_s=1e-6,
    mixed_precision=False,
)


def matmul_node(m: int, k: int, n: int) -> OpNode:
    a, w, out = (TensorMeta(shape=s, dtype="float32") for s in ((m, k), (n, k), (m, n)))
    return OpNode(
        name="mm",
        target="aten.linear.default",
        kind=NodeKind.MATMUL,
        inputs=("x", "w"),
        input_metas=(a, w),
        outputs=(out,),
        flops_fwd=2 * m * k * n,
        flops_bwd=4 * m * k * n,
        bytes_moved=a.nbytes + w.nbytes + out.nbytes,
    )


def test_roofline_compute_bound_matmul() -> None:
    node = matmul_node(1024, 1024, 1024)
    time = RooflineCompute(device=DEVICE).node_time(node)
    # forward: 2·2^30 FLOP / (1e12·0.5) = 4.295 ms (memory: 12 MiB / 5e10 = 0.25 ms) + 1 µs
    assert time.fwd_s == pytest.approx(2 * 1024**3 / 5e11 + 1e-6)
    assert time.bwd_s == pytest.approx(4 * 1024**3 / 5e11 + 1e-6)


def test_roofline_memory_bound_and_mixed_precision() -> None:
    node = matmul_node(4096, 8, 8)  # tiny k, n: bytes dominate
    time = RooflineCompute(device=DEVICE).node_time(node)
    assert time.fwd_s == pytest.approx(node.bytes_moved / 5e10 + 1e-6)
    mixed = dataclasses.replace(DEVICE, mixed_precision=True, peak_flops={"float32": 1e12, "bfloat16": 4e12})
    assert RooflineCompute(device=mixed).node_time(node).fwd_s == pytest.approx(node.bytes_moved / 2 / 5e10 + 1e-6)


def test_scaling_keeps_launch_overhead() -> None:
    time = NodeTime(fwd_s=1e-3 + 1e-6, bwd_s=2e-3 + 1e-6, overhead_s=1e-6)
    half = time.scaled(0.5)
    assert half.fwd_s == pytest.approx(0.5e-3 + 1e-6) and half.bwd_s == pytest.approx(1e-3 + 1e-6)


def test_data_parallel_estimate_hand_worked() -> None:
    graph = captured("mlp", 16, "export", hidden=256, layers=2)
    cluster = load_cluster("dgx-a100")
    setup = CostSetup(cluster=cluster, compute=RooflineCompute(device=cluster.device), optimizer="adam-mixed")
    estimate = data_parallel_estimate(graph, setup, devices=tuple(range(8)))
    # 4 x (256x256 + 256) bf16 gradients, 0.5 MiB in all: one DDP bucket, so one all-reduce with its whole latency
    assert ddp_buckets([p.meta.numel * 2 for p in reversed(graph.params)]) == [graph.num_params * 2]
    expected_sync = all_reduce_s(graph.num_params * 2, num_devices=8, link=cluster.intra_node)
    breakdown = estimate.breakdown_s
    assert breakdown["grad_sync_s"] == pytest.approx(expected_sync)
    assert breakdown["compute_s"] == pytest.approx(compute_s(graph, setup, num_batch_shards=8))
    memory_bandwidth = cluster.device.memory_bandwidth * cluster.device.memory_efficiency
    assert breakdown["bucket_copy_s"] == pytest.approx(4 * 2 * graph.num_params / memory_bandwidth)  # bf16 grads
    alone = data_parallel_estimate(graph, setup, devices=(0,))
    assert alone.breakdown_s["bucket_copy_s"] == alone.breakdown_s["grad_sync_s"] == 0
    assert estimate.step_time_s == pytest.approx(sum(breakdown.values()))
    assert estimate.memory_per_device_bytes >= model_state_bytes(graph.num_params, optimizer="adam-mixed")
    total_flops = graph.flops_fwd + graph.flops_bwd
    assert estimate.tflops_per_device == pytest.approx(total_flops / estimate.step_time_s / 8 / 1e12)
    assert 0 < estimate.mfu < 1 and estimate.bubble_fraction == 0


def test_more_devices_less_compute_more_sync() -> None:
    graph = captured("gpt", 16, "export", size="tiny")
    cluster = load_cluster("p3.16xlarge", num_nodes=2)
    setup = CostSetup(cluster=cluster, compute=RooflineCompute(device=cluster.device), optimizer="adam-mixed")
    one_node = data_parallel_estimate(graph, setup, devices=tuple(range(8)))
    two_nodes = data_parallel_estimate(graph, setup, devices=tuple(range(16)))
    assert two_nodes.breakdown_s["compute_s"] < one_node.breakdown_s["compute_s"]
    assert two_nodes.breakdown_s["grad_sync_s"] > one_node.breakdown_s["grad_sync_s"]  # crosses the 25 Gbit/s link
    assert two_nodes.memory_per_device_bytes < one_node.memory_per_device_bytes


def test_measured_times_price_data_parallel_on_one_replicas_batch() -> None:
    """Measured tables are not linear in the batch: the replica's own graph is priced, not 1/d of each node."""
    from cost_models.compute import ProfiledCompute
    from planner.baselines.data_parallel import data_parallel

    full, quarter = (captured("mlp", batch, "export", hidden=256, layers=2) for batch in (16, 4))
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=4)
    roofline = RooflineCompute(device=cluster.device)
    fixed = NodeTime(fwd_s=1e-3, bwd_s=2e-3)  # a per-node time that does not shrink with the batch
    table = {node.signature(): fixed for graph in (full, quarter) for node in graph}
    setup = CostSetup(cluster=cluster, compute=ProfiledCompute(table=table, fallback=roofline), optimizer="sgd")
    asked: list[int] = []

    def graph_at(batch: int):
        asked.append(batch)
        return quarter

    _, estimate = data_parallel(full, setup, batch_size=16, graph_at=graph_at)
    assert asked == [4]
    assert estimate.breakdown_s["compute_s"] == pytest.approx(3e-3 * len(quarter.nodes))
    rooflined = dataclasses.replace(setup, compute=roofline)
    _, linear = data_parallel(full, rooflined, batch_size=16, graph_at=graph_at)
    assert asked == [4]  # the roofline scales the full graph's times and needs no other graph
    assert linear.breakdown_s["compute_s"] == pytest.approx(compute_s(full, rooflined, num_batch_shards=4))
