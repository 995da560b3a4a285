"""Collective and point-to-point times on a mesh axis, in seconds (α-β model).

A stage's devices (global ranks, in order) form a logical mesh of ``mesh_shape``, laid out
row-major; the groups of mesh axis ``a`` are the sets of devices that differ only in their
coordinate on ``a`` (:func:`axis_groups`). A group that spans nodes uses the cluster's
inter-node link, as a :class:`~cost_models.cluster.GroupLink` that says how many nodes it spans,
otherwise the intra-node one (:func:`axis_link`).

For a group of ``n`` devices, ``b`` bytes per device, link latency ``α`` and inverse
bandwidth ``β`` (s/byte) (DESIGN.md, "Communication cost"):

* all-reduce       the cheapest of the algorithms the group's backend runs (NCCL: ring
  ``2(n−1)·α + 2·(n−1)/n·b·β``, double binary tree, hierarchical across nodes; gloo: ring) —
  :func:`all_reduce_s`, priced and chosen by :mod:`cost_models.collective_algorithms`
* all-gather       ring ``(n−1)·α + (n−1)/n·b·β`` (b = full size) — :func:`all_gather_s`
* reduce-scatter   ring ``(n−1)·α + (n−1)/n·b·β`` (b = full size) — :func:`reduce_scatter_s`
* all-to-all       ``(n−1)·α + (n−1)/n·b·β`` — each device keeps 1/n of its ``b`` bytes and
  sends ``b/n`` to each of the ``n−1`` others, one peer per step — :func:`all_to_all_s`
* point-to-point   ``α + b·β``                              — :func:`p2p_s`
* gradient sync under DDP: one all-reduce per bucket, latency included, buckets packed as torch's DDP
  packs them (1 MiB first, then 25 MiB) — :func:`ddp_all_reduce_s` (:func:`ddp_buckets`); the ILP's
  additive per-tensor share of it — :func:`bucketed_all_reduce_s`

``n = 1`` costs nothing. The all-reduce bus-bandwidth convention of nccl-tests
(busbw = algbw·2(n−1)/n, REFERENCES.md) is what makes ``bandwidth`` here comparable with
measured NCCL figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from cost_models.cluster import Cluster, Link
from cost_models.collective_algorithms import choose_all_reduce


def all_reduce_s(num_bytes: float, *, num_devices: int, link: Link) -> float:
    """The all-reduce NCCL would run for ``num_bytes`` over the group (:func:`choose_all_reduce`)."""
    if num_devices <= 1 or num_bytes <= 0:
        return 0.0
    return choose_all_reduce(num_bytes, num_devices=num_devices, link=link).seconds(num_bytes)


DDP_BUCKET_BYTES = 25 * 1024**2  # torch DDP's default bucket_cap_mb


def bucketed_all_reduce_s(
    num_bytes: float, *, num_devices: int, link: Link, bucket_bytes: float = DDP_BUCKET_BYTES
) -> float:
    """One gradient's additive share of a bucketed all-reduce, for the intra-op ILP (whose costs add up
    per node): a tensor of ``b`` bytes rides in a bucket of ``max(b, bucket_bytes)``, whose all-reduce
    algorithm is chosen for that size (:func:`choose_all_reduce`), and pays ``min(1, b / bucket_bytes)`` of
    its latency plus its per-byte term for ``b``. Summed over many small tensors this is one latency per
    bucket; the exact count of a whole stage's buckets is :func:`ddp_all_reduce_s`, which the estimate and
    the simulator charge.
    """
    if num_devices <= 1 or num_bytes <= 0:
        return 0.0
    price = choose_all_reduce(max(num_bytes, bucket_bytes), num_devices=num_devices, link=link)
    return min(1.0, num_bytes / bucket_bytes) * price.latency_s + num_bytes * price.per_byte_s


DDP_FIRST_BUCKET_BYTES = 1024**2  # torch DDP's first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES)


def ddp_buckets(
    sizes: Sequence[float],
    *,
    bucket_bytes: float = DDP_BUCKET_BYTES,
    first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
) -> list[float]:
    """Bytes of each bucket DDP packs gradients of ``sizes`` into, in the order given (DDP's order is the
    parameters reversed, as backward produces them): a bucket takes gradients until it holds at least its
    cap, then closes; the first bucket's cap is ``first_bucket_bytes``. A gradient is never split, so one
    larger than a cap is a bucket of its own (torch's ``_compute_bucket_assignment_by_size``)."""
    buckets: list[float] = []
    filling, cap = 0.0, first_bucket_bytes
    for size in sizes:
        filling += size
        if filling >= cap:
            buckets.append(filling)
            filling, cap = 0.0, bucket_bytes
    if filling > 0:
        buckets.append(filling)
    return buckets


def ddp_all_reduce_s(sizes: Sequence[float], *, num_devices: int, link: Link) -> float:
    """DDP's gradient sync: one all-reduce, latency and all, per bucket of :func:`ddp_buckets`."""
    return sum(all_reduce_s(bucket, num_devices=num_devices, link=link) for bucket in ddp_buckets(sizes))


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
    """The link collectives on ``axis`` run over: inter-node if any group spans nodes.

    The groups of an axis run their collectives at the same time, so the cross-node groups that touch
    one node share its NICs: with ``g`` of them on the busiest node, each sees the inter-node link as
    :meth:`Cluster.shared_inter_node` gives it for ``g`` flows (a ring enters and leaves a node once).
    It comes as :meth:`Cluster.spanning` gives it for the most nodes a group spans."""
    groups = axis_groups(devices, mesh_shape, axis)
    crossing: dict[int, int] = {}
    spanned = 1
    for group in groups:
        nodes = {cluster.node_of(rank) for rank in group}
        if len(nodes) > 1:
            spanned = max(spanned, len(nodes))
            for node in nodes:
                crossing[node] = crossing.get(node, 0) + 1
    if not crossing:
        return cluster.intra_node
    return cluster.spanning(cluster.shared_inter_node(flows_per_node=max(crossing.values())), num_nodes=spanned)


def stage_transfer_s(
    num_bytes: float, *, cluster: Cluster, sender_size: int, receiver_size: int, sender_nodes: int, crosses_nodes: bool
) -> float:
    """One direction of a pipeline boundary (an activation forward or its gradient back).

    ``num_bytes`` go over ``p = min(sender, receiver)`` device pairs at once, on the inter-node link when
    the stages are on different nodes (the ``p / sender_nodes`` pairs leaving one node share its NICs:
    :meth:`Cluster.shared_inter_node`), else the intra-node one; the receiver then regroups them inside
    each of its nodes, an all-gather over ``n = min(receiver, M)`` devices::

        α + (b / p)·β_link + all_gather(b·n / receiver, n, intra)
    """
    if num_bytes <= 0:
        return 0.0
    pairs = min(sender_size, receiver_size)
    if crosses_nodes:
        link = cluster.shared_inter_node(flows_per_node=math.ceil(pairs / max(sender_nodes, 1)))
    else:
        link = cluster.intra_node
    group = min(receiver_size, cluster.devices_per_node)
    regroup = all_gather_s(num_bytes * group / receiver_size, num_devices=group, link=cluster.intra_node)
    return link.latency_s + num_bytes / pairs / link.bandwidth + regroup


def placed_transfer_s(num_bytes: float, *, cluster: Cluster, sender: Sequence[int], receiver: Sequence[int]) -> float:
    """:func:`stage_transfer_s` between stages placed on the ranks ``sender`` and ``receiver`` (each stage's
    devices share a node or fill whole nodes, so its first rank says where it is)."""
    return stage_transfer_s(
        num_bytes,
        cluster=cluster,
        sender_size=len(sender),
        receiver_size=len(receiver),
        sender_nodes=len({cluster.node_of(rank) for rank in sender}),
        crosses_nodes=cluster.node_of(sender[0]) != cluster.node_of(receiver[0]),
    )


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
