"""Cluster presets, shape overrides, and custom cluster files (TOML and JSON)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cost_models.cluster import PRESET_NAMES, Cluster, GroupLink, load_cluster, preset
from cost_models.units import GIB
from planner.errors import AutoplanError
from tests.conftest import LAB_CLUSTER_TOML as TOML


def test_presets_follow_references() -> None:
    p3 = preset("p3.16xlarge")
    assert p3.devices_per_node == 8 and p3.device.memory_bytes == 16 * GIB
    assert p3.device.peak("bfloat16") == 125e12 and p3.device.memory_bandwidth == 900e9
    assert p3.inter_node.bandwidth == pytest.approx(25e9 / 8)  # 25 Gbit/s
    assert preset("dgx-a100").device.peak("bfloat16") == 312e12
    assert preset("dgx-h100").device.peak("bfloat16") == 989e12
    local = preset("local-cpu")
    assert local.num_devices >= 1 and not local.device.mixed_precision
    assert set(PRESET_NAMES) == {"local-cpu", "p3.16xlarge", "dgx-2h", "dgx-a100", "dgx-h100"}


def test_shape_overrides_and_ranks() -> None:
    cluster = load_cluster("dgx-a100", num_nodes=4, devices_per_node=2)
    assert cluster.num_devices == 8
    assert [cluster.node_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert cluster.link_between([0, 1]) == cluster.intra_node
    spanning = cluster.link_between([1, 2])
    assert (spanning.bandwidth, spanning.latency_s) == (cluster.inter_node.bandwidth, cluster.inter_node.latency_s)
    assert spanning == GroupLink(
        bandwidth=cluster.inter_node.bandwidth,
        latency_s=cluster.inter_node.latency_s,
        num_nodes=2,
        intra_node=cluster.intra_node,
        backend="nccl",
    )
    assert cluster.link_between(list(range(8))).num_nodes == 4
    with pytest.raises(AutoplanError, match="--nodes must be a positive"):
        load_cluster("dgx-a100", num_nodes=-1)


def test_toml_and_json_files(tmp_path: Path) -> None:
    path = tmp_path / "lab.toml"
    path.write_text(TOML)
    cluster = load_cluster(str(path), num_nodes=3)
    assert cluster.name == "lab" and cluster.num_devices == 12 and cluster.device.peak("float32") == 30e12
    assert cluster.device.compute_efficiency == 0.6 and cluster.inter_node.latency_s == 0
    json_path = tmp_path / "lab.json"
    json_path.write_text(json.dumps(cluster.to_json()))
    assert load_cluster(str(json_path)) == cluster
    assert Cluster.from_json(cluster.to_json()) == cluster


@pytest.mark.parametrize(
    ("text", "suffix", "message"),
    [
        ("num_nodes = [", ".toml", "is not valid toml"),
        ("{", ".json", "is not valid json"),
        ("[1, 2]", ".json", "must hold a table"),
        (TOML.replace("num_nodes = 2", "num_nodes = 0"), ".toml", "field num_nodes must be a positive integer, got 0"),
        (
            TOML.replace("devices_per_node = 4", "devices_per_node = 2.5"),
            ".toml",
            "devices_per_node must be a positive integer",
        ),
        (TOML.replace("memory_bandwidth = 300e9", ""), ".toml", "device: missing field memory_bandwidth"),
        (TOML.replace("[inter_node]", "[other]"), ".toml", r"missing section \[inter_node\]"),
        (TOML.replace("float32 = 30e12", "float32 = -1"), ".toml", "peak_flops must map dtypes to positive"),
    ],
)
def test_malformed_files_name_the_problem(tmp_path: Path, text: str, suffix: str, message: str) -> None:
    path = tmp_path / f"bad{suffix}"
    path.write_text(text)
    with pytest.raises(AutoplanError, match=message):
        load_cluster(str(path))


def test_missing_file_and_unknown_preset() -> None:
    with pytest.raises(AutoplanError, match=r"cluster file nowhere\.toml does not exist"):
        load_cluster("nowhere.toml")
    with pytest.raises(AutoplanError, match="unknown cluster preset 'tpu'"):
        load_cluster("tpu")
