"""ShardingSpec arithmetic, StageMesh links and reshard_s against hand-worked α-β values.

Links: intra-node 1 GB/s, 10 µs; inter-node 0.1 GB/s, 100 µs. The test tensor is 1024×1024
float32, W = 4 MiB = 4,194,304 bytes. Ring formulas (cost_models.communication), n devices:
all-gather of a full size b: (n−1)·α + (n−1)/n·b/B; all-to-all of b held: the same.
"""

from __future__ import annotations

import math

import pytest

from cost_models.cluster import Cluster, DeviceSpec, Link
from planner.ir.graph import TensorMeta
from planner.sharding.specs import REPLICATE, ShardingSpec, StageMesh, reshard_s, shard, shard_dim

INTRA = Link(bandwidth=1e9, latency_s=1e-5)
INTER = Link(bandwidth=1e8, latency_s=1e-4)
DEVICE = DeviceSpec(name="test", peak_flops={"float32": 1e12}, memory_bytes=2**34, memory_bandwidth=1e11)
W = 4 * 1024 * 1024
MATRIX = TensorMeta(shape=(1024, 1024), dtype="float32")
R = REPLICATE


def cluster(num_nodes: int = 1, devices_per_node: int = 8) -> Cluster:
    return Cluster(
        name="test",
        num_nodes=num_nodes,
        devices_per_node=devices_per_node,
        device=DEVICE,
        intra_node=INTRA,
        inter_node=INTER,
    )


def mesh(
    shape: tuple[int, ...], *, nodes: int = 1, per_node: int = 8, first: int = 0, itemsize: int | None = None
) -> StageMesh:
    return StageMesh(
        cluster=cluster(nodes, per_node),
        devices=tuple(range(first, first + math.prod(shape))),
        mesh_shape=shape,
        activation_itemsize=itemsize,
    )


def spec(*placements: str) -> ShardingSpec:
    return ShardingSpec(tuple(placements))


# --- ShardingSpec -------------------------------------------------------------------------


def test_placement_helpers_and_str():
    assert shard(0) == "S(0)" and shard(12) == "S(12)"
    assert shard_dim("S(3)") == 3 and shard_dim("S(12)") == 12
    assert shard_dim("R") is None
    assert str(spec(shard(0), R)) == "[S(0), R]"
    assert str(spec(R, shard(1))) == "[R, S(1)]"
    assert str(ShardingSpec.replicated(3)) == "[R, R, R]"
    assert ShardingSpec.replicated(2).is_replicated()
    assert not spec(R, shard(0)).is_replicated()
    assert spec(shard(0), R).dim_of(0) == 0 and spec(shard(0), R).dim_of(1) is None


def test_shards_per_dim_and_num_shards_on_a_2d_mesh():
    mesh_shape = (2, 4)
    assert spec(shard(0), shard(0)).shards_per_dim(mesh_shape) == {0: 8}  # one dim split on both axes
    assert spec(shard(0), shard(0)).num_shards(mesh_shape) == 8
    assert spec(shard(1), shard(0)).shards_per_dim(mesh_shape) == {1: 2, 0: 4}
    assert spec(shard(1), shard(0)).num_shards(mesh_shape) == 8
    assert spec(R, shard(2)).shards_per_dim(mesh_shape) == {2: 4}
    assert spec(R, shard(2)).num_shards(mesh_shape) == 4
    assert spec(shard(2), R).num_shards(mesh_shape) == 2
    assert ShardingSpec.replicated(2).shards_per_dim(mesh_shape) == {}
    assert ShardingSpec.replicated(2).num_shards(mesh_shape) == 1


def test_fits_requires_every_split_dim_to_exist_and_divide():
    mesh_shape = (2, 4)
    assert spec(shard(0), shard(0)).fits((8, 3), mesh_shape)  # 8 / (2·4)
    assert not spec(shard(0), shard(0)).fits((4, 3), mesh_shape)  # 4 / 8
    assert spec(shard(0), shard(1)).fits((6, 12), mesh_shape)  # 6/2, 12/4
    assert not spec(shard(0), shard(1)).fits((6, 10), mesh_shape)  # 10/4
    assert not spec(shard(1), R).fits((6, 3), mesh_shape)  # 3/2
    assert spec(R, shard(1)).fits((6, 4), mesh_shape)
    assert not spec(shard(2), R).fits((8, 8), mesh_shape)  # no dim 2
    assert ShardingSpec.replicated(2).fits((3, 5), mesh_shape)
    assert spec(shard(0)).fits((3,), (3,)) and not spec(shard(0)).fits((64,), (3,))


# --- StageMesh ------------------------------------------------------------------------------


def test_axis_links_follow_node_boundaries():
    """A spanning axis's link is the inter-node one, carrying the nodes its groups span (a GroupLink)."""
    two_nodes = mesh((2, 4), nodes=2, per_node=4)  # rows are nodes
    spanning = two_nodes.cluster.spanning(INTER, num_nodes=2)
    assert two_nodes.link(0) == spanning and two_nodes.link(1) == INTRA
    columns = mesh((4, 2), nodes=2, per_node=4)  # axis 0 groups (0, 2, 4, 6) span both nodes
    assert columns.link(0) == spanning and columns.link(1) == INTRA
    assert mesh((8,), nodes=2, per_node=4).link(0) == spanning
    assert mesh((4,), nodes=2, per_node=4, first=4).link(0) == INTRA  # all of node 1
    one_node = mesh((2, 4))
    assert one_node.link(0) == INTRA and one_node.link(1) == INTRA


def test_tensor_and_local_bytes():
    plain, half = mesh((2, 4)), mesh((2, 4), itemsize=2)
    assert plain.tensor_bytes(MATRIX) == W
    assert half.tensor_bytes(MATRIX) == W / 2  # floating tensors at the activation itemsize
    tokens = TensorMeta(shape=(1024, 512), dtype="int64")
    assert half.tensor_bytes(tokens) == plain.tensor_bytes(tokens) == W  # integers keep their size
    assert plain.local_bytes(MATRIX, spec(shard(0), shard(1))) == W / 8
    assert plain.local_bytes(MATRIX, spec(R, shard(0))) == W / 4


# --- reshard_s, one axis -----------------------------------------------------------------

GATHER_4 = 3e-5 + 0.75 * W / 1e9  # all-gather of W over 4 intra-node devices = 3.175728e-3


def test_identical_specs_cost_nothing():
    for placements in ((R,), (shard(0),), (shard(1),)):
        assert reshard_s(spec(*placements), spec(*placements), MATRIX, mesh((4,))) == 0.0
    assert reshard_s(spec(shard(0), shard(1)), spec(shard(0), shard(1)), MATRIX, mesh((2, 4))) == 0.0


def test_gather_to_replicated_is_one_all_gather_of_the_whole_tensor():
    m = mesh((4,))
    assert reshard_s(spec(shard(0)), spec(R), MATRIX, m) == pytest.approx(3.175728e-3, rel=1e-12)
    assert reshard_s(spec(shard(1)), spec(R), MATRIX, m) == pytest.approx(GATHER_4, rel=1e-12)
    # backward is a free local slice: no gradient does not make it cheaper
    assert reshard_s(spec(shard(0)), spec(R), MATRIX, m, requires_grad=False) == pytest.approx(GATHER_4, rel=1e-12)


def test_slice_from_replicated_costs_only_the_gradient_gather():
    m = mesh((4,))
    assert reshard_s(spec(R), spec(shard(0)), MATRIX, m, requires_grad=True) == pytest.approx(GATHER_4, rel=1e-12)
    assert reshard_s(spec(R), spec(shard(0)), MATRIX, m, requires_grad=False) == 0.0


def test_shard_to_other_shard_is_all_to_all_each_way():
    m = mesh((4,))
    one_way = 3e-5 + 0.75 * (W / 4) / 1e9  # each device holds W/4 before the exchange
    assert one_way == pytest.approx(8.16432e-4)
    assert reshard_s(spec(shard(0)), spec(shard(1)), MATRIX, m) == pytest.approx(2 * one_way, rel=1e-12)
    assert reshard_s(spec(shard(0)), spec(shard(1)), MATRIX, m, requires_grad=False) == pytest.approx(
        one_way, rel=1e-12
    )


def test_activation_itemsize_halves_floating_bytes_only():
    half = mesh((4,), itemsize=2)
    assert reshard_s(spec(shard(0)), spec(R), MATRIX, half) == pytest.approx(3e-5 + 0.75 * (W / 2) / 1e9, rel=1e-12)
    tokens = TensorMeta(shape=(1024, 512), dtype="int64")  # W bytes too
    assert reshard_s(spec(shard(0)), spec(R), tokens, half) == pytest.approx(GATHER_4, rel=1e-12)


def test_axis_spanning_nodes_uses_the_inter_node_link():
    m = mesh((2, 4), nodes=2, per_node=4)
    # axis 0 spans the nodes: 2 devices at 0.1 GB/s, 100 µs
    assert reshard_s(spec(shard(0), R), spec(R, R), MATRIX, m) == pytest.approx(1e-4 + 0.5 * W / 1e8, rel=1e-12)
    # axis 1 stays inside a node
    assert reshard_s(spec(R, shard(1)), spec(R, R), MATRIX, m) == pytest.approx(GATHER_4, rel=1e-12)
    flat = mesh((8,), nodes=2, per_node=4)
    assert reshard_s(spec(shard(0)), spec(R), MATRIX, flat) == pytest.approx(7e-4 + 7 / 8 * W / 1e8, rel=1e-12)
    # the all-to-all over the node boundary: W/2 held per device, both ways
    exchange = 2 * (1e-4 + 0.5 * (W / 2) / 1e8)
    assert reshard_s(spec(shard(0), R), spec(shard(1), R), MATRIX, m) == pytest.approx(exchange, rel=1e-12)


# --- reshard_s, several axes -------------------------------------------------------------


def test_gather_on_one_axis_moves_the_tensor_local_to_the_other_axes():
    m = mesh((2, 4), nodes=2, per_node=4)
    # axis 1 (4 devices, intra) gathers W/2: the tensor stays split in 2 on axis 0
    assert reshard_s(spec(shard(0), shard(1)), spec(shard(0), R), MATRIX, m) == pytest.approx(
        3e-5 + 0.75 * (W / 2) / 1e9, rel=1e-12
    )
    # axis 0 (2 devices, inter) gathers W/4: the tensor stays split in 4 on axis 1
    assert reshard_s(spec(shard(0), shard(1)), spec(R, shard(1)), MATRIX, m) == pytest.approx(
        1e-4 + 0.5 * (W / 4) / 1e8, rel=1e-12
    )


def test_gather_on_both_axes_brings_seven_eighths_of_the_tensor_to_each_device():
    """[S(0), S(1)] -> [R, R] on 2×4: each device must receive 7/8 of W, whatever the order.

    Gathering axis 1 (W/2 full) and then axis 0 (W full): 3/4·W/2 + 1/2·W = 7/8·W. Counting
    both gathers on the tensor as split by the other axis (W/2 and W/4) gives 1/2·W, less than
    the bytes that must arrive.
    """
    m = mesh((2, 4))
    expected = 3e-5 + 1e-5 + 0.875 * W / 1e9  # = 3.710016e-3
    assert expected == pytest.approx(3.710016e-3)
    assert reshard_s(spec(shard(0), shard(1)), spec(R, R), MATRIX, m) == pytest.approx(expected, rel=1e-12)
    assert reshard_s(spec(shard(0), shard(0)), spec(R, R), MATRIX, m) == pytest.approx(expected, rel=1e-12)
    # slicing on both axes: the gradient's gathers mirror the forward ones
    assert reshard_s(spec(R, R), spec(shard(0), shard(1)), MATRIX, m) == pytest.approx(expected, rel=1e-12)
    assert reshard_s(spec(R, R), spec(shard(0), shard(1)), MATRIX, m, requires_grad=False) == 0.0
    # on two nodes the whole tensor crosses the inter-node axis, W/2 the intra-node one
    two = mesh((2, 4), nodes=2, per_node=4)
    across = (3e-5 + 0.75 * (W / 2) / 1e9) + (1e-4 + 0.5 * W / 1e8)
    assert reshard_s(spec(shard(0), shard(1)), spec(R, R), MATRIX, two) == pytest.approx(across, rel=1e-12)


def test_move_a_split_from_one_axis_to_the_other():
    """[S(0), R] -> [R, S(0)] on 2×4: slice on axis 1 (its gradient gathers W/2 over 4), gather
    on axis 0 of the tensor then split 4 ways on axis 1 (W/4 over 2)."""
    m = mesh((2, 4))
    slice_grad = 3e-5 + 0.75 * (W / 2) / 1e9
    gather = 1e-5 + 0.5 * (W / 4) / 1e9
    assert reshard_s(spec(shard(0), R), spec(R, shard(0)), MATRIX, m) == pytest.approx(slice_grad + gather, rel=1e-12)
    assert reshard_s(spec(shard(0), R), spec(R, shard(0)), MATRIX, m, requires_grad=False) == pytest.approx(
        gather, rel=1e-12
    )


def test_single_device_axes_cost_nothing():
    m = mesh((1, 4))
    assert reshard_s(spec(shard(0), R), spec(R, R), MATRIX, m) == 0.0
    assert reshard_s(spec(shard(0), shard(1)), spec(R, shard(1)), MATRIX, m) == 0.0
