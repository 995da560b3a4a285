"""Roofline node times and the data-parallel estimate, against hand-worked values."""

from __future__ import annotations

import dataclasses

import pytest

from cost_models.cluster import DeviceSpec, load_cluster
from cost_models.communication import all_reduce_s, ddp_buckets
from cost_models.compute import NodeTime, RooflineCompute
from cost_models.memory import model_state_bytes, optimizer_bytes
from planner.costing.estimate import compute_s, optimizer_step_s
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


def _data_parallel_estimate(graph, setup, *, num_devices: int, batch_size: int = 16):
    from planner.baselines.data_parallel import data_parallel

    cluster = dataclasses.replace(
        setup.cluster,
        num_nodes=max(1, num_devices // setup.cluster.devices_per_node),
        devices_per_node=min(num_devices, setup.cluster.devices_per_node),
    )
    return data_parallel(graph, dataclasses.replace(setup, cluster=cluster), batch_size=batch_size)[1]


def test_data_parallel_estimate_hand_worked() -> None:
    graph = captured("mlp", 16, "export", hidden=256, layers=2)
    cluster = load_cluster("dgx-a100")
    flat = dataclasses.replace(cluster.device, kernels=None)  # the flat roofline: a replica's share is 1/d of the time
    cluster = dataclasses.replace(cluster, device=flat)
    setup = CostSetup(cluster=cluster, compute=RooflineCompute(device=flat), optimizer="adam-mixed")
    estimate = _data_parallel_estimate(graph, setup, num_devices=8)
    # 4 x (256x256 + 256) bf16 gradients, 0.5 MiB in all: one DDP bucket, ready when the backward ends, so one
    # all-reduce with its whole latency after it
    assert ddp_buckets([p.meta.numel * 4 for p in reversed(graph.params)]) == [graph.num_params * 4]
    expected_sync = all_reduce_s(
        graph.num_params * optimizer_bytes("adam-mixed").grads, num_devices=8, link=cluster.intra_node
    )
    breakdown = estimate.breakdown_s
    assert breakdown["grad_sync_s"] == pytest.approx(expected_sync)
    assert breakdown["compute_s"] == pytest.approx(compute_s(graph, setup, num_batch_shards=8))
    memory_bandwidth = cluster.device.memory_bandwidth * cluster.device.memory_efficiency
    grad_bytes = optimizer_bytes("adam-mixed").grads * graph.num_params
    copies = 4 * grad_bytes / memory_bandwidth  # the gradients into DDP's buckets and back
    optimizer = optimizer_step_s(graph.num_params, setup)  # reads and writes weights and Adam state, reads grads
    assert breakdown["optimizer_and_bucket_copies_s"] == pytest.approx(copies + optimizer)
    alone = _data_parallel_estimate(graph, setup, num_devices=1)
    assert alone.breakdown_s["grad_sync_s"] == 0
    assert alone.breakdown_s["optimizer_and_bucket_copies_s"] == pytest.approx(optimizer)
    assert estimate.breakdown_error() is None and alone.breakdown_error() is None
    assert estimate.memory_per_device_bytes >= model_state_bytes(graph.num_params, optimizer="adam-mixed")
    total_flops = graph.flops_fwd + graph.flops_bwd
    assert estimate.tflops_per_device == pytest.approx(total_flops / estimate.step_time_s / 8 / 1e12)
    assert 0 < estimate.mfu < 1 and estimate.bubble_fraction == 0


def test_more_devices_less_compute_more_sync() -> None:
    # rows enough that a replica's kernels are past the GPU's launch and dispatch floor
    graph = captured("gpt", 512, "export", size="tiny")
    cluster = load_cluster("p3.16xlarge", num_nodes=2)
    setup = CostSetup(cluster=cluster, compute=RooflineCompute(device=cluster.device), optimizer="adam-mixed")
    one_node = _data_parallel_estimate(graph, setup, num_devices=8, batch_size=512)
    two_nodes = _data_parallel_estimate(graph, setup, num_devices=16, batch_size=512)
    assert two_nodes.breakdown_s["compute_s"] < one_node.breakdown_s["compute_s"]
    one, two = (
        estimate.breakdown_s["grad_sync_s"] + estimate.hidden_s["grad_sync_overlapped_s"]
        for estimate in (one_node, two_nodes)
    )
    assert two > one  # crosses the 25 Gbit/s link
    assert two_nodes.memory_per_device_bytes < one_node.memory_per_device_bytes
