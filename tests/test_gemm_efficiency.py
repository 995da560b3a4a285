"""The GPU kernel shape model: tile and wave quantization, small K and M, attention, CPU devices unchanged."""

from __future__ import annotations

import dataclasses

import pytest

from cost_models.cluster import Cluster, load_cluster, preset
from cost_models.compute import NodeTime, RooflineCompute
from cost_models.gemm_efficiency import (
    GemmShape,
    KernelSpec,
    backward_shapes,
    gemm_efficiency,
    gemm_s,
    kernel_s,
    matmul_shape,
    num_waves,
)
from cost_models.gpu_devices import A100_KERNELS
from cost_models.units import GIB
from planner.errors import AutoplanError
from planner.ir.graph import NodeKind, OpNode, TensorArg, TensorMeta

A100_PEAK = 312e12


def _linear(m: int, n: int, k: int, *, dtype: str = "bfloat16") -> OpNode:
    x, w = TensorMeta(shape=(1, m, k), dtype=dtype), TensorMeta(shape=(n, k), dtype=dtype)
    y = TensorMeta(shape=(1, m, n), dtype=dtype)
    return OpNode(
        name="linear",
        target="aten.linear.default",
        kind=NodeKind.MATMUL,
        inputs=("x", "w"),
        input_metas=(x, w),
        outputs=(y,),
        params=("w",),
        args=(TensorArg(0), TensorArg(1)),
        flops_fwd=2 * m * n * k,
        flops_bwd=4 * m * n * k,
        bytes_moved=x.nbytes + w.nbytes + y.nbytes,
    )


def _attention(*, causal: bool) -> OpNode:
    q = TensorMeta(shape=(4, 16, 2048, 128), dtype="bfloat16")
    flops = 4 * 4 * 16 * 2048 * 2048 * 128
    return OpNode(
        name="sdpa",
        target="aten.scaled_dot_product_attention.default",
        kind=NodeKind.ATTENTION,
        inputs=("q", "k", "v"),
        input_metas=(q, q, q),
        outputs=(q,),
        args=(TensorArg(0), TensorArg(1), TensorArg(2), None, 0.0, causal),
        flops_fwd=flops,
        flops_bwd=2 * flops,
        bytes_moved=4 * q.nbytes,
    )


def test_one_tile_more_than_the_sms_takes_two_waves() -> None:
    one_tile = dataclasses.replace(A100_KERNELS, tiles=((256, 128),))
    full = GemmShape(1, 256 * 108, 128, 4096)  # 108 tiles: one wave on 108 SMs
    over = GemmShape(1, 256 * 109, 128, 4096)  # 109 tiles
    assert num_waves(108, 108) == 1 and num_waves(109, 108) == 2
    assert kernel_s(one_tile, over, peak=A100_PEAK) == pytest.approx(2 * kernel_s(one_tile, full, peak=A100_PEAK))
    # with every cuBLAS tile to choose from, the extra tile costs far less than a second wave
    assert kernel_s(A100_KERNELS, over, peak=A100_PEAK) < 1.5 * kernel_s(A100_KERNELS, full, peak=A100_PEAK)


def test_tile_quantization_pads_a_ragged_edge() -> None:
    single = dataclasses.replace(A100_KERNELS, tiles=((128, 128),), num_sms=1)
    aligned = gemm_efficiency(single, GemmShape(1, 1024, 1024, 4096), peak=A100_PEAK)
    ragged = gemm_efficiency(single, GemmShape(1, 1025, 1024, 4096), peak=A100_PEAK)  # one row of tiles nearly empty
    assert ragged == pytest.approx(aligned * 1025 / (1024 + 128))


def test_small_k_and_small_m_are_slower_per_flop() -> None:
    big = gemm_efficiency(A100_KERNELS, GemmShape(1, 8192, 8192, 8192), peak=A100_PEAK)
    assert gemm_efficiency(A100_KERNELS, GemmShape(1, 8192, 8192, 64), peak=A100_PEAK) < 0.5 * big
    assert gemm_efficiency(A100_KERNELS, GemmShape(1, 16, 8192, 8192), peak=A100_PEAK) < 0.2 * big
    assert big <= 1.0


def test_the_reference_shape_runs_at_the_published_efficiency() -> None:
    m, n, k = A100_KERNELS.gemm_reference
    efficiency = gemm_efficiency(A100_KERNELS, GemmShape(1, m, n, k), peak=A100_PEAK)
    assert efficiency == pytest.approx(A100_KERNELS.gemm_efficiency)


def test_matmul_shapes_of_linear_and_batched_matmul() -> None:
    assert matmul_shape(_linear(4096, 1024, 512), output_shape=(1, 4096, 1024), flops=2 * 4096 * 1024 * 512) == (
        GemmShape(1, 4096, 1024, 512)
    )
    # the local share of a column-parallel split: N / 4, same K
    assert matmul_shape(_linear(4096, 1024, 512), output_shape=(1, 4096, 256), flops=2 * 4096 * 256 * 512) == (
        GemmShape(1, 4096, 256, 512)
    )
    a = TensorMeta(shape=(8, 64, 32), dtype="bfloat16")
    b = TensorMeta(shape=(8, 32, 16), dtype="bfloat16")
    bmm = OpNode(
        name="bmm",
        target="aten.bmm.default",
        kind=NodeKind.MATMUL,
        inputs=("a", "b"),
        input_metas=(a, b),
        outputs=(TensorMeta(shape=(8, 64, 16), dtype="bfloat16"),),
    )
    assert matmul_shape(bmm, output_shape=(8, 64, 16), flops=2 * 8 * 64 * 16 * 32) == GemmShape(8, 64, 16, 32)
    assert backward_shapes(GemmShape(1, 4096, 1024, 512)) == (
        GemmShape(1, 4096, 512, 1024),
        GemmShape(1, 512, 1024, 4096),
    )


def test_backward_is_two_gemms_at_their_own_shapes() -> None:
    device = preset("dgx-a100").device
    node = _linear(16384, 512, 8192)  # dW = Xᵀ·dY: 8192×512 outputs over 16384 rows; dX: 16384×8192 over 512
    time = RooflineCompute(device=device).node_time(node)
    shape = GemmShape(1, 16384, 512, 8192)
    peak = device.peak("bfloat16")
    expected = sum(gemm_s(A100_KERNELS, part, peak=peak) for part in backward_shapes(shape))
    assert time.bwd_s == pytest.approx(expected + device.kernel_overhead_s)
    assert time.fwd_s == pytest.approx(gemm_s(A100_KERNELS, shape, peak=peak) + device.kernel_overhead_s)


def test_a_split_is_priced_at_the_local_shape() -> None:
    compute = RooflineCompute(device=preset("dgx-a100").device)
    node = _linear(2048, 1536, 1536)
    whole = compute.node_time(node)
    split = compute.local_time(node, shards=8, output_shards={2: 8})  # 192 columns each: few tiles per wave
    assert split.total_s > whole.scaled(1 / 8).total_s
    assert compute.measures_shapes


def test_cpu_devices_keep_the_flat_roofline() -> None:
    device = preset("local-cpu").device
    assert device.kernels is None
    compute = RooflineCompute(device=device)
    assert not compute.measures_shapes
    node = _linear(2048, 1536, 1536, dtype="float32")
    time = compute.node_time(node)
    peak = device.peak("float32") * device.compute_efficiency
    bandwidth = device.memory_bandwidth * device.memory_efficiency
    fwd = max(node.flops_fwd / peak, node.bytes_moved / bandwidth) + device.kernel_overhead_s
    bwd = max(node.flops_bwd / peak, 2 * node.bytes_moved / bandwidth) + device.kernel_overhead_s
    assert time == NodeTime(fwd_s=fwd, bwd_s=bwd, overhead_s=device.kernel_overhead_s)
    assert compute.local_time(node, shards=4, output_shards={2: 4}) == time.scaled(1 / 4)


def test_memory_bound_operators_run_at_achievable_bandwidth() -> None:
    device = preset("dgx-a100").device
    assert 0.8 < device.memory_efficiency < 0.95  # measured streaming share, not the data sheet's peak
    x = TensorMeta(shape=(8, 2048, 4096), dtype="bfloat16")
    gelu = OpNode(
        name="gelu",
        target="aten.gelu.default",
        kind=NodeKind.ELEMENTWISE,
        inputs=("x",),
        input_metas=(x,),
        outputs=(x,),
        flops_fwd=0,
        bytes_moved=2 * x.nbytes,
    )
    time = RooflineCompute(device=device).node_time(gelu)
    achievable = device.memory_bandwidth * device.memory_efficiency
    assert time.fwd_s == pytest.approx(2 * x.nbytes / achievable + device.kernel_overhead_s)


def test_causal_attention_does_half_the_work_and_backward_two_and_a_half_times() -> None:
    device = preset("dgx-a100").device
    compute = RooflineCompute(device=device)
    full, causal = compute.node_time(_attention(causal=False)), compute.node_time(_attention(causal=True))
    overhead = device.kernel_overhead_s
    assert causal.fwd_s - overhead == pytest.approx((full.fwd_s - overhead) / 2)
    flops = _attention(causal=True).flops_fwd / 2
    peak = device.peak("bfloat16")
    assert causal.fwd_s == pytest.approx(flops / (peak * A100_KERNELS.attention_fwd_efficiency) + overhead)
    assert causal.bwd_s == pytest.approx(2.5 * flops / (peak * A100_KERNELS.attention_bwd_efficiency) + overhead)


def test_kernel_spec_fields_are_checked() -> None:
    data = A100_KERNELS.to_json()
    assert KernelSpec.from_json(data, where="test") == A100_KERNELS
    with pytest.raises(AutoplanError, match=r"device\.kernels"):
        KernelSpec.from_json({**data, "num_sms": 0}, where="test")
    with pytest.raises(AutoplanError, match=r"device\.kernels"):
        KernelSpec.from_json({key: value for key, value in data.items() if key != "k_prologue"}, where="test")


def test_dgx_2h_preset_loads() -> None:
    cluster = load_cluster("dgx-2h", num_nodes=32)
    assert cluster.num_devices == 512 and cluster.devices_per_node == 16 and cluster.nics_per_node == 8
    device = cluster.device
    assert device.peak("float16") == 125e12 and device.memory_bytes == 32 * GIB and device.memory_bandwidth == 900e9
    assert device.kernels is not None and device.kernels.num_sms == 80
    assert cluster.intra_node.bandwidth == 150e9  # NVSwitch: 300 GB/s bidirectional per GPU
    assert cluster.inter_node.bandwidth == pytest.approx(0.9 * 100e9 / 8)  # one 100 Gbit/s NIC at ~90%
    assert Cluster.from_json(cluster.to_json()) == cluster  # the kernel model survives a plan's JSON


def test_a_cluster_file_may_give_a_kernel_model(tmp_path) -> None:
    text = """
name = "lab"
num_nodes = 1
devices_per_node = 8
[device]
name = "A100"
peak_flops = { bfloat16 = 312e12 }
memory_bytes = 85_899_345_920
memory_bandwidth = 2.039e12
[device.kernels]
num_sms = 108
l2_bandwidth = 7.2e12
k_prologue = 128
gemm_efficiency = 0.87
gemm_reference = [1024, 10240, 5120]
attention_fwd_efficiency = 0.6
attention_bwd_efficiency = 0.45
[intra_node]
bandwidth = 200e9
latency_s = 5e-6
[inter_node]
bandwidth = 23e9
latency_s = 15e-6
"""
    path = tmp_path / "lab.toml"
    path.write_text(text)
    kernels = load_cluster(str(path)).device.kernels
    assert kernels is not None and kernels.num_sms == 108 and kernels.tiles == A100_KERNELS.tiles
    path.write_text(text.replace("num_sms = 108", "num_sms = -1"))
    with pytest.raises(AutoplanError, match=r"device\.kernels"):
        load_cluster(str(path))


def test_a_pass_is_never_faster_than_the_host_issues_it() -> None:
    """A tiny operator costs eager PyTorch's host time per call (forward, backward); a large one its kernel's time."""
    device = preset("dgx-a100").device
    assert device.kernels is not None and device.kernels.host_forward_s > device.kernel_overhead_s
    compute = RooflineCompute(device=device)
    tiny = TensorMeta(shape=(4, 8), dtype="bfloat16")
    gelu = OpNode(
        name="gelu",
        target="aten.gelu.default",
        kind=NodeKind.ELEMENTWISE,
        inputs=("x",),
        input_metas=(tiny,),
        outputs=(tiny,),
        flops_fwd=0,
        bytes_moved=2 * tiny.nbytes,
    )
    time = compute.node_time(gelu)
    assert (time.fwd_s, time.bwd_s) == (device.kernels.host_forward_s, device.kernels.host_backward_s)
    assert compute.local_time(gelu, shards=4, output_shards={0: 4}).fwd_s == device.kernels.host_forward_s
    big = _linear(8192, 8192, 8192)
    assert compute.node_time(big).fwd_s > 100 * device.kernels.host_forward_s


def test_norms_stream_at_their_measured_bandwidth() -> None:
    """LayerNorm at the device's norm_memory_efficiency (pytorch PR #87445 on A100), below a streaming kernel's."""
    device = preset("dgx-a100").device
    assert device.kernels is not None
    norm = device.kernels.norm_memory_efficiency
    assert norm is not None and norm < device.memory_efficiency
    x = TensorMeta(shape=(8192, 4096), dtype="bfloat16")
    layer_norm = OpNode(
        name="layer_norm",
        target="aten.layer_norm.default",
        kind=NodeKind.NORM,
        inputs=("x",),
        input_metas=(x,),
        outputs=(x,),
        flops_fwd=0,
        bytes_moved=2 * x.nbytes,
    )
    time = RooflineCompute(device=device).node_time(layer_norm)
    forward_bytes = 2 * x.numel * 2  # read and write, 2 bytes an element
    assert time.fwd_s == pytest.approx(forward_bytes / (device.memory_bandwidth * norm) + device.kernel_overhead_s)
    # the measurement it comes from: forward and backward of 8192×4096 in fp16 in 509 µs
    assert time.total_s == pytest.approx(509e-6, rel=0.03)
