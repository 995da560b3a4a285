"""Collective and point-to-point times on a mesh axis, in seconds (α-β model).

A stage's devices (global ranks, in order) form a logical mesh of ``mesh_shape``, laid out
row-major; the groups of mesh axis ``a`` are the sets of devices that differ only in their
coordinate on ``a`` (:func:`axis_groups`). A group that spans nodes uses the cluster's
inter-node link, otherwise the intra-node one (:func:`axis_link`).

For a group of ``n`` devices, ``b`` bytes per device, link latency ``α`` and inverse
bandwidth ``β`` (s/byte), ring algorithms give (DESIGN.md, "Communication cost"):

* all-reduce       ``2(n−1)·α + 2·(n−1)/n·b·β``            — :func:`all_reduce_s`
* all-gather       ``(n−1)·α + (n−1)/n·b·β`` (b = full size) — :func:`all_gather_s`
* reduce-scatter   ``(n−1)·α + (n−1)/n·b·β`` (b = full size) — :func:`reduce_scatter_s`
* all-to-all       ``(n−1)·α + (n−1)/n·b·β`` — each device keeps 1/n of its ``b`` bytes and
  sends ``b/n`` to each of the ``n−1`` others, one peer per step — :func:`all_to_all_s`
* point-to-point   ``α + b·β``                              — :func:`p2p_s`
* gradient sync     all-reduce with the latency paid once per 25 MiB bucket — :func:`bucketed_all_reduce_s`

``n = 1`` costs nothing. The all-reduce bus-bandwidth convention of nccl-tests
(busbw = algbw·2(n−1)/n, REFERENCES.md) is what makes ``bandwidth`` here comparable with
measured NCCL figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from cost_models.cluster import Cluster, Link


def all_reduce_s(num_bytes: float, *, num_devices: int, link: Link) -> float:
    if num_devices <= 1 or num_bytes <= 0:
        return 0.0
    n = num_devices
    return 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * num_bytes / link.bandwidth


DDP_BUCKET_BYTES = 25 * 1024**2  # torch DDP's default bucket_cap_mb


def bucketed_all_reduce_s(
    num_bytes: float, *, num_devices: int, link: Link, bucket_bytes: float = DDP_BUCKET_BYTES
) -> float:
    """Share of a bucketed gradient all-reduce: latency paid per bucket, not per tensor.

    Gradients are all-reduced in buckets of ``bucket_bytes`` (DDP's 25 MiB), so a tensor of
    ``b`` bytes pays ``min(1, b / bucket_bytes)`` of the ring's ``2(n−1)·α`` latency plus its
    bandwidth term; summed over tensors this is the cost of the buckets.
    """
    if num_devices <= 1 or num_bytes <= 0:
        return 0.0
    n = num_devices
    latency_share = min(1.0, num_bytes / bucket_bytes)
    return latency_share * 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * num_bytes / link.bandwidth


def all_gather_s(num_bytes: float, *, num_devices: int, link: Link) -> float:
    """``num_bytes`` is the size of the gathered (full) tensor."""
    if num_devices <= 1 or num_bytes <= 0:
        return 0.0
    n = num_devices
    return (n - 1) * link.latency_s + (n - 1) / n * num_bytes / link.bandwidth


def reduce_scatter_s(num_bytes: float, *, num_devices: int, link: Link) -> float:
    """``num_bytes`` is the size of the full tensor each device contributes."""
    return all_gather_s(num_bytes, num_devices=num_devices, link=link)


def all_to_all_s(num_bytes: float, *, num_devices: int, link: Link) -> float:
    """``num_bytes`` is what each device holds before the exchange."""
    if num_devices <= 1 or num_bytes <= 0:
        return 0.0
    n = num_devices
    return (n - 1) * link.latency_s + (n - 1) / n * num_bytes / link.bandwidth


def p2p_s(num_bytes: float, *, link: Link) -> float:
    if num_bytes <= 0:
        return 0.0
    return link.transfer_s(num_bytes)


def axis_groups(devices: Sequence[int], mesh_shape: Sequence[int], axis: int) -> list[tuple[int, ...]]:
    """The device groups along mesh ``axis`` of ``devices`` laid out row-major in ``mesh_shape``."""
    assert math.prod(mesh_shape) == len(devices), f"mesh {tuple(mesh_shape)} does not hold {len(devices)} devices"
    assert 0 <= axis < len(mesh_shape), f"axis {axis} out of range for mesh {tuple(mesh_shape)}"
    strides = [math.prod(mesh_shape[i + 1 :]) for i in range(len(mesh_shape))]
    groups = []
    for flat in range(len(devices)):
        if (flat // strides[axis]) % mesh_shape[axis] != 0:
            continue
        groups.append(tuple(devices[flat + k * strides[axis]] for k in range(mesh_shape[axis])))
    return groups


def axis_link(cluster: Cluster, devices: Sequence[int], mesh_shape: Sequence[int], axis: int) -> Link:
    """The link collectives on ``axis`` run over: inter-node if any group spans nodes."""
    groups = axis_groups(devices, mesh_shape, axis)
    if any(len({cluster.node_of(rank) for rank in group}) > 1 for group in groups):
        return cluster.inter_node
    return cluster.intra_node


COLLECTIVES = {
    "all_reduce": all_reduce_s,
    "all_gather": all_gather_s,
    "reduce_scatter": reduce_scatter_s,
    "all_to_all": all_to_all_s,
}


def collective_s(
    kind: str, num_bytes: float, *, cluster: Cluster, devices: Sequence[int], mesh_shape: Sequence[int], axis: int
) -> float:
    """Time of collective ``kind`` over mesh ``axis`` of a stage's devices."""
    link = axis_link(cluster, devices, mesh_shape, axis)
    return COLLECTIVES[kind](num_bytes, num_devices=mesh_shape[axis], link=link)
