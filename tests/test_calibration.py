"""Calibration fits (calibration.fit) and one real gloo run (calibration.measure)."""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import replace

import numpy as np
import pytest

from calibration.fit import (
    CALIBRATED_NAME,
    CalibrationResult,
    Sample,
    collective_coefficients,
    fit_alpha_beta,
    fit_calibration,
    fit_collective,
    fit_matmul,
    fit_memory_bandwidth,
    shared_slowdown,
    to_toml,
)
from calibration.measure import run_calibration, write_cluster_file
from cost_models.cluster import Cluster, Link, load_cluster, preset
from cost_models.communication import all_gather_s, all_reduce_s, p2p_s
from planner.errors import AutoplanError

SIZES_BYTES = [2**k for k in range(10, 25, 2)]  # 1 KiB .. 16 MiB
TRUE_LINK = Link(bandwidth=2.5e9, latency_s=40e-6)


def _collective_samples(kind: str, *, num_devices: int, link: Link, noise: float = 0.0, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    times = {
        "all_reduce": lambda b: all_reduce_s(b, num_devices=num_devices, link=link),
        "all_gather": lambda b: all_gather_s(b, num_devices=num_devices, link=link),
        "p2p": lambda b: p2p_s(b, link=link),
    }[kind]
    return [
        Sample(kind=kind, num_devices=num_devices, num_bytes=b, seconds=times(b) * (1 + noise * rng.uniform(-1, 1)))
        for b in SIZES_BYTES
    ]


def _synthetic_result() -> CalibrationResult:
    samples = [
        s
        for kind in ("all_reduce", "all_gather", "p2p")
        for s in _collective_samples(kind, num_devices=2, link=TRUE_LINK)
    ]
    samples += [
        Sample(kind="matmul", num_devices=1, num_bytes=3 * m * m * 4, seconds=1e-6 + 2 * m**3 / 5e10, flops=2.0 * m**3)
        for m in (8, 256, 1024)
    ]
    samples += [
        Sample(kind="memory_copy", num_devices=1, num_bytes=2**28, seconds=2**28 / 8e9),
        Sample(kind="memory_add", num_devices=1, num_bytes=3 * 2**27, seconds=3 * 2**27 / 1e10),
    ]
    return fit_calibration(
        samples, num_processes=2, hostname="test-host", torch_version="0.0", date="2024-01-01T00:00:00+00:00"
    )


def _assert_close(link: Link, expected: Link, *, rel: float) -> None:
    assert link.bandwidth == pytest.approx(expected.bandwidth, rel=rel)
    assert link.latency_s == pytest.approx(expected.latency_s, rel=rel)


@pytest.mark.parametrize(
    ("kind", "num_devices", "expected"),
    [
        ("all_reduce", 4, (6.0, 1.5)),
        ("all_gather", 4, (3.0, 0.75)),
        ("p2p", 4, (1.0, 1.0)),
        ("all_reduce", 2, (2.0, 1.0)),
    ],
)
def test_coefficients_match_communication_formulas(kind: str, num_devices: int, expected: tuple[float, float]) -> None:
    assert collective_coefficients(kind, num_devices=num_devices) == pytest.approx(expected)


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "p2p"])
@pytest.mark.parametrize("num_devices", [2, 8])
def test_exact_samples_recover_alpha_and_bandwidth(kind: str, num_devices: int) -> None:
    samples = _collective_samples(kind, num_devices=num_devices, link=TRUE_LINK)
    _assert_close(fit_collective(kind, samples), TRUE_LINK, rel=0.01)
    latency_steps, byte_factor = collective_coefficients(kind, num_devices=num_devices)
    pairs = [(s.num_bytes, s.seconds) for s in samples]
    _assert_close(fit_alpha_beta(pairs, latency_steps=latency_steps, byte_factor=byte_factor), TRUE_LINK, rel=0.01)


@pytest.mark.parametrize("seed", range(5))
def test_noisy_samples_recover_within_ten_percent(seed: int) -> None:
    samples = _collective_samples("all_reduce", num_devices=2, link=TRUE_LINK, noise=0.03, seed=seed)
    _assert_close(fit_collective("all_reduce", samples), TRUE_LINK, rel=0.10)


def test_negative_intercept_clamps_alpha_to_zero() -> None:
    bandwidth = 1e9
    samples = [(b, max(b / bandwidth - 50e-6, 1e-7)) for b in (2**20, 2**22, 2**24)]  # line through t < 0 at b = 0
    link = fit_alpha_beta(samples, latency_steps=1.0, byte_factor=1.0)
    assert link.latency_s == 0.0
    assert link.bandwidth > 0 and math.isfinite(link.bandwidth)


def test_flat_times_keep_bandwidth_positive() -> None:
    samples = [(1024.0, 2e-3), (2**20, 1e-3), (2**24, 1e-3)]  # shrinking with size: a fit slope ≤ 0
    link = fit_alpha_beta(samples, latency_steps=2.0, byte_factor=1.0)
    assert link.latency_s >= 0.0
    assert link.bandwidth > 0 and math.isfinite(link.bandwidth)


def test_one_device_collective_is_a_user_error() -> None:
    with pytest.raises(AutoplanError, match="at least 2 devices"):
        collective_coefficients("all_reduce", num_devices=1)


def test_single_sample_fits_bandwidth_only() -> None:
    link = fit_alpha_beta([(1e6, 1e-3)], latency_steps=1.0, byte_factor=1.0)
    assert link == Link(bandwidth=pytest.approx(1e9), latency_s=0.0)


@pytest.mark.parametrize("samples", [[], [(0.0, 1.0)], [(1.0, -1.0)], [(1.0, math.nan)]])
def test_bad_samples_are_user_errors(samples: list[tuple[float, float]]) -> None:
    with pytest.raises(AutoplanError):
        fit_alpha_beta(samples, latency_steps=1.0, byte_factor=1.0)


def test_matmul_and_memory_fits() -> None:
    peak, overhead = 5e10, 2e-6
    fit = fit_matmul([(2.0 * m**3, overhead + 2.0 * m**3 / peak) for m in (8, 128, 512, 1024)])
    assert fit.peak_flops == pytest.approx(peak, rel=0.01)
    assert fit.kernel_overhead_s == pytest.approx(overhead, rel=0.05)
    assert fit_memory_bandwidth([(2e8, 0.02), (3e8, 0.03), (1e8, 0.05)]) == pytest.approx(1e10)


def test_eager_operator_overhead_raises_the_kernel_overhead() -> None:
    """A tiny operator costs the framework's dispatch and autograd, not just the matmul intercept."""
    matmul = [
        Sample(kind="matmul", num_devices=1, num_bytes=12, seconds=1e-6 + 2 * m**3 / 5e10, flops=2.0 * m**3)
        for m in (8, 1024)
    ]
    memory = [Sample(kind="memory_copy", num_devices=1, num_bytes=2**28, seconds=2**28 / 8e9)]
    eager = [Sample(kind="op_overhead", num_devices=1, num_bytes=0, seconds=1.2e-5)]
    common = {"num_processes": 1, "hostname": "h", "torch_version": "0", "date": "2024-01-01"}
    without = fit_calibration(matmul + memory, **common)
    with_eager = fit_calibration(matmul + memory + eager, **common)
    assert without.matmul.kernel_overhead_s < 1.2e-5
    assert with_eager.matmul.kernel_overhead_s == pytest.approx(1.2e-5)
    assert with_eager.matmul.peak_flops == without.matmul.peak_flops


def test_shared_slowdown_is_the_reference_matmul_with_all_running_over_alone() -> None:
    def matmul(kind: str, size: int, seconds: float) -> Sample:
        return Sample(kind=kind, num_devices=1, num_bytes=12 * size * size, seconds=seconds, flops=2.0 * size**3)

    shared = [matmul("matmul", 256, 0.5e-3), matmul("matmul", 512, 4.2e-3)]
    assert shared_slowdown(shared, [matmul("matmul_alone", 512, 2.1e-3)]) == pytest.approx(2.0)
    assert shared_slowdown(shared, [matmul("matmul_alone", 512, 5e-3)]) == 1.0  # noise cannot speed it up
    assert shared_slowdown(shared, []) == 1.0
    memory = [Sample(kind="memory_copy", num_devices=1, num_bytes=2**28, seconds=2**28 / 8e9)]
    result = fit_calibration(
        [*shared, matmul("matmul_alone", 512, 1.4e-3), *memory],
        num_processes=4,
        hostname="h",
        torch_version="0",
        date="2024-01-01",
    )
    assert result.shared_slowdown == pytest.approx(3.0)
    assert replace(result, links={"all_reduce": TRUE_LINK}).to_cluster().device.shared_slowdown == pytest.approx(3.0)


def test_to_cluster_uses_measured_figures() -> None:
    result = _synthetic_result()
    base = preset("local-cpu")
    cluster = result.to_cluster(base)
    assert cluster.name == CALIBRATED_NAME
    assert (cluster.num_nodes, cluster.devices_per_node) == (base.num_nodes, base.devices_per_node)
    device = cluster.device
    assert set(device.peak_flops) == {"float32", "bfloat16", "float16"}
    assert all(value == pytest.approx(5e10, rel=0.01) for value in device.peak_flops.values())
    assert (device.compute_efficiency, device.memory_efficiency) == (1.0, 1.0)
    assert device.memory_bandwidth == pytest.approx(9e9)
    assert device.memory_bytes == base.device.memory_bytes
    assert device.kernel_overhead_s == pytest.approx(1e-6, rel=0.05)
    assert cluster.intra_node == cluster.inter_node == result.links["all_reduce"]
    _assert_close(cluster.intra_node, TRUE_LINK, rel=0.01)
    assert set(result.links) == {"all_reduce", "all_gather", "p2p"}


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_cluster_file_round_trip(tmp_path, suffix: str) -> None:
    result = _synthetic_result()
    path = write_cluster_file(result, tmp_path / f"cluster{suffix}")
    assert load_cluster(str(path)) == result.to_cluster()
    text = path.read_text()
    data = tomllib.loads(text) if suffix == ".toml" else json.loads(text)
    calibration = data["calibration"]
    assert calibration["hostname"] == "test-host"
    assert calibration["num_processes"] == 2
    assert set(calibration["links"]) == {"all_reduce", "all_gather", "p2p"}
    assert len(calibration["samples"]) == len(result.samples)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


def test_cluster_file_rejects_other_suffixes(tmp_path) -> None:
    with pytest.raises(AutoplanError, match=r"\.json or \.toml"):
        write_cluster_file(_synthetic_result(), tmp_path / "cluster.yaml")
    with pytest.raises(AutoplanError, match="does not exist"):
        write_cluster_file(_synthetic_result(), tmp_path / "missing" / "cluster.json")


def test_to_toml_round_trips_nested_tables() -> None:
    data = {
        "name": 'a "b"',
        "n": 3,
        "on": True,
        "x": 1e-5,
        "t": {"u": [1, 2], "v": {"w": 2.5}},
        "rows": [{"k": "a"}, {"k": "b"}],
    }
    assert tomllib.loads(to_toml(data)) == data


def test_run_calibration_rejects_one_process() -> None:
    with pytest.raises(AutoplanError, match="at least 2 processes"):
        run_calibration(num_processes=1, quick=True)


@pytest.mark.slow
def test_quick_calibration_on_two_processes(tmp_path) -> None:
    messages: list[str] = []
    result = run_calibration(num_processes=2, quick=True, progress=messages.append)
    assert {"matmul", "matmul_alone", "op_overhead", "memory_copy", "all_reduce", "all_gather", "p2p"} <= {
        s.kind for s in result.samples
    }
    assert result.shared_slowdown >= 1.0 and math.isfinite(result.shared_slowdown)
    eager = [s.seconds for s in result.samples if s.kind == "op_overhead"]
    assert result.matmul.kernel_overhead_s >= max(eager)
    assert all(s.seconds > 0 and math.isfinite(s.seconds) for s in result.samples)
    for link in result.links.values():
        assert link.latency_s >= 0 and math.isfinite(link.latency_s)
        assert link.bandwidth > 0 and math.isfinite(link.bandwidth)
    assert result.matmul.peak_flops > 0 and math.isfinite(result.matmul.peak_flops)
    assert result.memory_bandwidth > 0 and math.isfinite(result.memory_bandwidth)
    assert any(message.startswith("fit all_reduce") for message in messages)
    cluster = load_cluster(str(write_cluster_file(result, tmp_path / "local.json")))
    assert isinstance(cluster, Cluster) and cluster.name == CALIBRATED_NAME
