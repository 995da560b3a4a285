"""All-reduce algorithms against hand-worked values, and the chooser that picks what NCCL would."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_models.cluster import GroupLink, Link, load_cluster
from cost_models.collective_algorithms import (
    BUTTERFLY,
    HIERARCHICAL,
    RING,
    TREE,
    GroupShape,
    all_reduce_prices,
    butterfly_all_reduce,
    choose_all_reduce,
    describe_all_reduce,
    hierarchical_all_reduce,
    ring_all_reduce,
    tree_all_reduce,
)
from cost_models.communication import all_reduce_s, bucketed_all_reduce_s, ddp_all_reduce_s

INTRA = Link(bandwidth=100e9, latency_s=5e-6)  # 100 GB/s, 5 µs
INTER = Link(bandwidth=10e9, latency_s=20e-6)  # 10 GB/s, 20 µs


def spanning(num_nodes: int, *, backend: str = "nccl") -> GroupLink:
    return GroupLink(
        bandwidth=INTER.bandwidth, latency_s=INTER.latency_s, num_nodes=num_nodes, intra_node=INTRA, backend=backend
    )


def test_ring_hand_worked() -> None:
    # 64 devices on 8 nodes, 1 GB: 2·63·20 µs + 2·(63/64)·0.1 s
    price = ring_all_reduce(GroupShape.of(64, spanning(8)))
    assert price.seconds(1e9) == pytest.approx(2 * 63 * 20e-6 + 2 * 63 / 64 * 0.1)


def test_tree_hand_worked() -> None:
    # 64 devices on 8 nodes: chain of 8 inside a node, log2(8) = 3 levels across:
    # 2·(7·5 µs + 3·20 µs) + 2·1 GB / (0.9·10 GB/s)
    price = tree_all_reduce(GroupShape.of(64, spanning(8)))
    assert price.latency_s == pytest.approx(2 * (7 * 5e-6 + 3 * 20e-6))
    assert price.seconds(1e9) == pytest.approx(2 * (7 * 5e-6 + 3 * 20e-6) + 2 * 1e9 / 9e9)
    # 6 nodes: ⌊log2 6⌋ = 2 levels (NCCL's log2i)
    assert tree_all_reduce(GroupShape.of(6, spanning(6))).latency_s == pytest.approx(2 * 2 * 20e-6)


def test_butterfly_hand_worked_and_power_of_two_only() -> None:
    # 16 devices on one link: 2·log2(16)·20 µs + 2·(15/16)·b·β
    price = butterfly_all_reduce(GroupShape.of(16, INTER))
    assert price is not None and price.algorithm == BUTTERFLY
    assert price.seconds(1e9) == pytest.approx(8 * 20e-6 + 2 * 15 / 16 * 0.1)
    assert butterfly_all_reduce(GroupShape.of(12, INTER)) is None


def test_hierarchical_hand_worked() -> None:
    # 64 on 8 nodes, 1 GB, NCCL's node-by-node ring: of its 2·63 steps 2·7 cross nodes (20 µs each), the other 112
    # stay inside one (5 µs); every step's b/n through the slowest link: 2·(63/64)·0.1 s
    price = hierarchical_all_reduce(GroupShape.of(64, spanning(8)))
    assert price is not None and price.algorithm == HIERARCHICAL
    latency = 112 * 5e-6 + 2 * 7 * 20e-6
    assert price.seconds(1e9) == pytest.approx(latency + 2 * 63 / 64 * 1e9 / 10e9)
    ring = ring_all_reduce(GroupShape.of(64, spanning(8)))
    assert ring.seconds(1e9) - price.seconds(1e9) == pytest.approx(2 * 56 * (20e-6 - 5e-6))  # latency only


def test_hierarchical_only_when_the_group_spans_nodes_with_several_devices_on_each() -> None:
    assert hierarchical_all_reduce(GroupShape.of(8, INTRA)) is None  # one node
    assert hierarchical_all_reduce(GroupShape.of(8, spanning(8))) is None  # one device per node
    names = {price.algorithm for price in all_reduce_prices(8, INTRA)}
    assert names == {RING, TREE}


def test_one_device_costs_nothing() -> None:
    assert choose_all_reduce(1e9, num_devices=1, link=spanning(2)).seconds(1e9) == 0.0
    assert all_reduce_s(1e9, num_devices=1, link=spanning(2)) == 0.0


def test_ring_for_large_messages_on_small_groups() -> None:
    assert choose_all_reduce(1e9, num_devices=8, link=INTRA).algorithm == RING
    assert choose_all_reduce(1e9, num_devices=2, link=spanning(2)).algorithm == RING  # the tree moves 2b/0.9


def test_hierarchical_for_large_messages_across_nodes() -> None:
    """Across nodes a ring pushes 2(n−1)/n of the bytes through each node boundary, the hierarchical
    all-reduce 2(N−1)/N of them: on 2 nodes of 8, half."""
    assert choose_all_reduce(1e9, num_devices=16, link=spanning(2)).algorithm == HIERARCHICAL


def test_tree_or_hierarchical_for_small_messages_and_large_groups() -> None:
    assert choose_all_reduce(1e4, num_devices=64, link=spanning(8)).algorithm in (TREE, HIERARCHICAL)
    assert choose_all_reduce(25 * 2**20, num_devices=1024, link=spanning(128)).algorithm == TREE
    assert choose_all_reduce(1e4, num_devices=128, link=spanning(128)).algorithm == TREE  # one device per node


def test_inside_one_node_the_ring_is_kept() -> None:
    """A node's tree is a chain: the ring's latency with more bytes, so it never wins there."""
    for num_bytes in (1.0, 1e4, 1e9):
        assert choose_all_reduce(num_bytes, num_devices=8, link=INTRA).algorithm == RING


def test_gloo_runs_a_ring() -> None:
    assert choose_all_reduce(1e4, num_devices=64, link=spanning(8, backend="gloo")).algorithm == RING
    cpu = load_cluster("local-cpu", num_nodes=4, devices_per_node=2)
    assert cpu.link_between([0, 2, 4, 6]).backend == "gloo"


def test_butterfly_is_chosen_only_where_offered() -> None:
    assert choose_all_reduce(1e4, num_devices=16, link=INTER).algorithm == RING
    assert choose_all_reduce(1e4, num_devices=16, link=INTER, offered=(BUTTERFLY,)).algorithm == BUTTERFLY


def test_bucketed_share_uses_the_bucket_s_algorithm() -> None:
    """Four quarter-bucket tensors pay one bucket's all-reduce, tree latency and all."""
    link, bucket = spanning(128), 25 * 2**20
    whole = all_reduce_s(bucket, num_devices=1024, link=link)
    assert choose_all_reduce(bucket, num_devices=1024, link=link).algorithm == TREE
    assert 4 * bucketed_all_reduce_s(bucket / 4, num_devices=1024, link=link) == pytest.approx(whole)
    assert ddp_all_reduce_s([bucket], num_devices=1024, link=link) == pytest.approx(whole)


def test_the_stage_s_link_carries_its_nodes() -> None:
    dgx = load_cluster("dgx-a100", num_nodes=8)
    link = dgx.link_between(list(range(64)))
    # a 25 MiB bucket: the tree's 2·7 + 2·3 latencies beat the node-by-node ring's 2·63; 1 GiB: the ring's bytes win
    assert describe_all_reduce(25 * 2**20, num_devices=64, link=link) == (
        "all-reduce 25.0 MiB over 64 devices on 8 nodes: tree"
    )
    assert describe_all_reduce(2**30, num_devices=64, link=link) == (
        "all-reduce 1024.0 MiB over 64 devices on 8 nodes: hierarchical"
    )
    assert describe_all_reduce(1e9, num_devices=8, link=dgx.intra_node) == "all-reduce 953.7 MiB over 8 devices: ring"


@settings(max_examples=200, deadline=None)
@given(
    num_bytes=st.floats(min_value=1.0, max_value=1e10),
    num_nodes=st.integers(min_value=1, max_value=512),
    per_node=st.integers(min_value=1, max_value=16),
    gloo=st.booleans(),
)
def test_chosen_time_is_the_cheapest_offered_never_above_the_ring(
    num_bytes: float, num_nodes: int, per_node: int, gloo: bool
) -> None:
    link = spanning(num_nodes, backend="gloo" if gloo else "nccl") if num_nodes > 1 else INTRA
    devices = num_nodes * per_node
    chosen = choose_all_reduce(num_bytes, num_devices=devices, link=link).seconds(num_bytes)
    offered = [price.seconds(num_bytes) for price in all_reduce_prices(devices, link)]
    ring = ring_all_reduce(GroupShape.of(devices, link)).seconds(num_bytes)
    assert chosen == min(offered) if devices > 1 else chosen == 0.0
    assert chosen <= ring


def test_the_published_view_prices_each_row_s_data_parallel_all_reduce_both_ways() -> None:
    """GPT-76.1B on 1024 A100s: 32 replicas, one per node; a 25 MiB bucket goes by the tree, the stage's whole
    gradient (4.4 GiB) by the ring, whose price is the one it had."""
    from benchmarks.published_cases import rows
    from benchmarks.published_collectives import collectives_table

    row = next(row for row in rows() if row.name == "gpt-76.1b")
    line = collectives_table([row]).splitlines()[-1]
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert cells[:5] == ["gpt-76.1b", "1024", "8·4·32", "32 devices on 32 nodes", "25 MiB"]
    assert cells[6].startswith("tree ") and float(cells[6].split()[1]) < float(cells[5])
    assert cells[9] == f"ring {cells[8]}"
