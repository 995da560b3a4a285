"""α-β collective formulas against hand-worked values, and mesh-axis link selection."""

from __future__ import annotations

import pytest

from cost_models.cluster import Link, load_cluster
from cost_models.communication import (
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    axis_groups,
    axis_link,
    bucketed_all_reduce_s,
    collective_s,
    p2p_s,
    reduce_scatter_s,
)

LINK = Link(bandwidth=1e9, latency_s=1e-5)  # 1 GB/s, 10 µs


def test_all_reduce_hand_worked() -> None:
    # 4 devices, 1 GB: 2·3·10 µs + 2·(3/4)·1 s = 60 µs + 1.5 s
    assert all_reduce_s(1e9, num_devices=4, link=LINK) == pytest.approx(1.5 + 60e-6)
    # 2 devices, 8 bytes: latency-bound, 2·1·10 µs + 2·(1/2)·8 ns
    assert all_reduce_s(8, num_devices=2, link=LINK) == pytest.approx(20e-6 + 8e-9)


def test_gather_scatter_hand_worked() -> None:
    # 8 devices, 800 MB gathered: 7·10 µs + (7/8)·0.8 s
    assert all_gather_s(8e8, num_devices=8, link=LINK) == pytest.approx(70e-6 + 0.7)
    assert reduce_scatter_s(8e8, num_devices=8, link=LINK) == pytest.approx(70e-6 + 0.7)
    # all-reduce = reduce-scatter + all-gather
    assert all_reduce_s(8e8, num_devices=8, link=LINK) == pytest.approx(2 * all_gather_s(8e8, num_devices=8, link=LINK))


def test_all_to_all_and_p2p_hand_worked() -> None:
    # 4 devices, 400 MB each: 3·10 µs + (3/4)·0.4 s
    assert all_to_all_s(4e8, num_devices=4, link=LINK) == pytest.approx(30e-6 + 0.3)
    assert p2p_s(1e6, link=LINK) == pytest.approx(1e-5 + 1e-3)
    assert p2p_s(0, link=LINK) == 0.0


def test_single_device_costs_nothing() -> None:
    for formula in (all_reduce_s, all_gather_s, reduce_scatter_s, all_to_all_s):
        assert formula(1e9, num_devices=1, link=LINK) == 0.0


def test_axis_groups_row_major() -> None:
    devices = tuple(range(8))
    assert axis_groups(devices, (2, 4), 1) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert axis_groups(devices, (2, 4), 0) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert axis_groups((8, 9, 10, 11), (4,), 0) == [(8, 9, 10, 11)]


def test_axis_spanning_nodes_uses_inter_node_link() -> None:
    cluster = load_cluster("p3.16xlarge", num_nodes=2)
    devices = tuple(range(16))
    assert axis_link(cluster, devices, (2, 8), 1) == cluster.intra_node
    assert axis_link(cluster, devices, (2, 8), 0) == cluster.inter_node
    assert axis_link(cluster, devices, (16,), 0) == cluster.inter_node
    slow = collective_s("all_reduce", 1e8, cluster=cluster, devices=devices, mesh_shape=(2, 8), axis=0)
    fast = collective_s("all_reduce", 1e8, cluster=cluster, devices=devices, mesh_shape=(8, 2), axis=1)
    assert slow > 10 * fast


def test_bucketed_all_reduce_pays_latency_per_bucket() -> None:
    bucket = 25 * 1024**2
    whole = all_reduce_s(bucket, num_devices=4, link=LINK)
    assert bucketed_all_reduce_s(bucket, num_devices=4, link=LINK) == pytest.approx(whole)
    quarter = bucketed_all_reduce_s(bucket / 4, num_devices=4, link=LINK)
    assert 4 * quarter == pytest.approx(whole)
    assert (
        bucketed_all_reduce_s(2 * bucket, num_devices=4, link=LINK)
        < all_reduce_s(2 * bucket, num_devices=4, link=LINK) + 1e-12
    )
