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
    ddp_all_reduce_s,
    ddp_buckets,
    p2p_s,
    placed_transfer_s,
    reduce_scatter_s,
    stage_transfer_s,
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
    assert axis_link(cluster, devices, (2, 8), 0).latency_s == cluster.inter_node.latency_s
    assert axis_link(cluster, devices, (16,), 0) == cluster.spanning(cluster.inter_node, num_nodes=2)
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


def test_concurrent_cross_node_groups_share_the_nodes_nics() -> None:
    """p3.16xlarge has one 25 Gbit/s NIC per node: the 8 groups of a (2, 8) mesh's axis 0 all cross it at
    once, so each gets an eighth; a DGX A100 has a NIC per GPU, so its 8 groups each keep a whole one."""
    p3 = load_cluster("p3.16xlarge", num_nodes=2)
    devices = tuple(range(16))
    assert axis_link(p3, devices, (2, 8), 0).bandwidth == pytest.approx(p3.inter_node.bandwidth / 8)
    assert axis_link(p3, devices, (16,), 0).bandwidth == p3.inter_node.bandwidth  # one ring, one flow per node
    dgx = load_cluster("dgx-a100", num_nodes=2)
    assert axis_link(dgx, devices, (2, 8), 0) == dgx.spanning(dgx.inter_node, num_nodes=2)
    eighth = p3.spanning(Link(bandwidth=p3.inter_node.bandwidth / 8, latency_s=p3.inter_node.latency_s), num_nodes=2)
    eight_groups = collective_s("all_reduce", 1e8, cluster=p3, devices=devices, mesh_shape=(2, 8), axis=0)
    assert eight_groups == pytest.approx(all_reduce_s(1e8, num_devices=2, link=eighth))


def test_pipeline_pairs_leaving_a_node_share_its_nics() -> None:
    p3 = load_cluster("p3.16xlarge", num_nodes=2)
    dgx = load_cluster("dgx-a100", num_nodes=2)

    def crossing_s(cluster, pairs: int) -> float:
        return stage_transfer_s(
            1e9, cluster=cluster, sender_size=pairs, receiver_size=pairs, sender_nodes=1, crosses_nodes=True
        )

    # one NIC: 8 pairs move the bytes no faster than one pair (the regroup inside the receiver aside)
    assert crossing_s(p3, 8) > 0.9 * crossing_s(p3, 1)
    # a NIC per GPU: 8 pairs move the bytes 8x faster (the regroup inside the receiver's node is extra)
    assert crossing_s(dgx, 8) < 0.25 * crossing_s(dgx, 1)


def test_a_placed_transfer_reads_sizes_nodes_and_crossing_off_the_ranks() -> None:
    dgx = load_cluster("dgx-a100", num_nodes=3)
    two_nodes = placed_transfer_s(1e9, cluster=dgx, sender=range(16), receiver=range(16, 24))
    assert two_nodes == stage_transfer_s(
        1e9, cluster=dgx, sender_size=16, receiver_size=8, sender_nodes=2, crosses_nodes=True
    )
    one_node = placed_transfer_s(1e9, cluster=dgx, sender=(0, 1), receiver=(2, 3))
    assert one_node == stage_transfer_s(
        1e9, cluster=dgx, sender_size=2, receiver_size=2, sender_nodes=1, crosses_nodes=False
    )
    assert two_nodes > one_node > 0


def test_nics_per_node_round_trips_through_the_cluster_file(tmp_path) -> None:
    import json

    from cost_models.cluster import Cluster

    p3 = load_cluster("p3.16xlarge", num_nodes=2)
    path = tmp_path / "p3.json"
    path.write_text(json.dumps(p3.to_json()))
    assert load_cluster(str(path)).nics_per_node == 1
    assert Cluster.from_json(load_cluster("dgx-a100").to_json()).nics_per_node is None


def test_ddp_packs_buckets_as_torch_does() -> None:
    mib = 1024**2
    # the first bucket closes at 1 MiB; later ones at 25 MiB; a gradient is never split
    assert ddp_buckets([10 * mib, 10 * mib, 10 * mib]) == [10 * mib, 20 * mib]
    assert ddp_buckets([0.5 * mib, 0.5 * mib, 30 * mib, 1 * mib]) == [1 * mib, 30 * mib, 1 * mib]
    assert ddp_buckets([]) == []


def test_ddp_sync_pays_one_latency_per_bucket() -> None:
    mib = 1024**2
    sizes = [10 * mib] * 6  # buckets: 10, 30, 20 MiB
    expected = sum(all_reduce_s(b * mib, num_devices=4, link=LINK) for b in (10, 30, 20))
    assert ddp_all_reduce_s(sizes, num_devices=4, link=LINK) == pytest.approx(expected)
    # the additive per-tensor share pays 6 x 10/25 = 2.4 latencies where DDP pays 3
    shares = sum(bucketed_all_reduce_s(size, num_devices=4, link=LINK) for size in sizes)
    assert ddp_all_reduce_s(sizes, num_devices=4, link=LINK) - shares == pytest.approx(0.6 * 2 * 3 * LINK.latency_s)
