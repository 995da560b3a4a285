"""All-reduce algorithms, and the one NCCL would run, in seconds (α-β model).

A group of ``n`` devices spans ``N`` nodes with ``m = ⌈n/N⌉`` of them on a node (:class:`GroupLink` says so;
a plain :class:`~cost_models.cluster.Link` is a group inside one node). It communicates over its link
(``α``, ``β`` = 1/bandwidth: the inter-node link as the group sees it when ``N > 1``) and, inside a node, over
the intra-node link (``α_i``, ``β_i``). An all-reduce of ``b`` bytes per device costs, by algorithm (each a
latency plus a per-byte term, :class:`AlgorithmPrice`):

* ring — ``2(n−1)·α + 2(n−1)/n·b·β``: every step on the group's slowest link — :func:`ring_all_reduce`;
* tree — NCCL's double binary tree: a chain through the ``m`` devices of each node and two binary trees over the
  ``N`` nodes, each carrying half the data, pipelined; reduce up, broadcast down:
  ``2·((m−1)·α_i + ⌊log2 N⌋·α) + 2·b·β / 0.9`` — :func:`tree_all_reduce`. The latency is NCCL's tuning model's
  (``ncclTopoTuneModel`` in NVIDIA/nccl ``src/graph/tuning.cc``: tree latency
  ``2·((nRanks/nNodes − 1)·intraLat + log2i(nNodes)·interLat)``), and so is the bandwidth: the tree's bus
  bandwidth is 0.9 of the ring's per channel (``busBw·.9``) and its algorithm bandwidth half of that
  (``ratio = .5``), so the bytes cost ``2·b·β/0.9`` where the ring's cost ``2(n−1)/n·b·β``: the tree only wins
  on latency (small messages, many nodes). NCCL's medium-size ``treeCorrectionFactor`` is left out;
* butterfly — recursive halving-doubling (Rabenseifner): a reduce-scatter by recursive halving and an
  all-gather by recursive doubling, ``log2 n`` steps each, for power-of-two ``n`` only:
  ``2·log2(n)·α + 2(n−1)/n·b·β`` — :func:`butterfly_all_reduce` (Thakur, Rabenseifner & Gropp 2005,
  "Optimization of collective communication operations in MPICH"). NCCL does not run it;
* hierarchical — across nodes, as NCCL runs it: its rings are laid out node by node, so only ``2(N−1)`` of their
  ``2(n−1)`` steps cross the network (tuning.cc's ring latency ``(nsteps − nInterSteps)·intraLat +
  nInterSteps·interLat``), while every step still moves ``b/n`` through the slowest link:
  ``2(n−N)·α_i + 2(N−1)·α + 2(n−1)/n·b·β``, for a group on several nodes with several devices on each —
  :func:`hierarchical_all_reduce`. The textbook two-level algorithm (reduce-scatter inside each node, all-reduce
  of ``b/m`` across the nodes, all-gather inside) would also cut the bytes crossing a node to ``2(N−1)/N·b``; NCCL's
  ring and tree do not (its tree's bytes are priced below the ring's, above), so that saving is not charged: the
  hierarchical choice saves latency only.

:func:`choose_all_reduce` picks, per all-reduce, the cheapest at ``b`` of the algorithms the group's backend
offers (:data:`OFFERED`): NCCL's ring, tree and (as its node-by-node ring) hierarchical — NCCL picks by the
lowest time its tuning model predicts, which is this rule on these prices; gloo (CPU processes) runs a ring.
The ring is always offered, so the choice never costs more than a ring. ``n = 1`` (or ``b = 0``) costs
nothing. All-gather, reduce-scatter and all-to-all stay rings (:mod:`cost_models.communication`): NCCL's
tuning model offers them the ring alone (tuning.cc skips every other algorithm for them); NCCL 2.23's PAT for
all-gather/reduce-scatter runs only at one GPU per node and is not modelled. :func:`describe_all_reduce` says
the choice in words for ``plan --explain``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from cost_models.cluster import GroupLink, Link
from cost_models.units import MIB

RING, TREE, BUTTERFLY, HIERARCHICAL = "ring", "tree", "butterfly", "hierarchical"
# The all-reduce algorithms each backend runs (module docstring).
OFFERED = {"nccl": (RING, TREE, HIERARCHICAL), "gloo": (RING,)}
TREE_BANDWIDTH_SHARE = 0.9  # NCCL's tree bus bandwidth against the ring's (tuning.cc: busBw * .9)


@dataclass(frozen=True, kw_only=True)
class AlgorithmPrice:
    """An algorithm's all-reduce time: ``latency_s + b · per_byte_s`` for ``b`` bytes per device."""

    algorithm: str
    latency_s: float
    per_byte_s: float

    def seconds(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes * self.per_byte_s


@dataclass(frozen=True, kw_only=True)
class GroupShape:
    """How a group of ``num_devices`` sits on nodes, read off its link: ``num_nodes`` nodes, ``per_node`` devices
    on the fullest one, ``intra_node`` the link inside a node."""

    num_devices: int
    num_nodes: int
    per_node: int
    link: Link
    intra_node: Link
    backend: str

    @classmethod
    def of(cls, num_devices: int, link: Link) -> GroupShape:
        if isinstance(link, GroupLink) and link.num_nodes > 1:
            nodes = min(link.num_nodes, num_devices)
            return cls(
                num_devices=num_devices,
                num_nodes=nodes,
                per_node=math.ceil(num_devices / nodes),
                link=link,
                intra_node=link.intra_node,
                backend=link.backend,
            )
        backend = link.backend if isinstance(link, GroupLink) else "nccl"
        return cls(
            num_devices=num_devices, num_nodes=1, per_node=num_devices, link=link, intra_node=link, backend=backend
        )


def ring_all_reduce(group: GroupShape) -> AlgorithmPrice:
    n, link = group.num_devices, group.link
    return AlgorithmPrice(
        algorithm=RING, latency_s=2 * (n - 1) * link.latency_s, per_byte_s=2 * (n - 1) / n / link.bandwidth
    )


def tree_all_reduce(group: GroupShape) -> AlgorithmPrice:
    depth = group.num_nodes.bit_length() - 1  # ⌊log2 N⌋, NCCL's log2i
    latency = 2 * ((group.per_node - 1) * group.intra_node.latency_s + depth * group.link.latency_s)
    return AlgorithmPrice(
        algorithm=TREE, latency_s=latency, per_byte_s=2 / (TREE_BANDWIDTH_SHARE * group.link.bandwidth)
    )


def butterfly_all_reduce(group: GroupShape) -> AlgorithmPrice | None:
    """None unless the group is a power of two."""
    n, link = group.num_devices, group.link
    if n & (n - 1):
        return None
    steps = n.bit_length() - 1
    return AlgorithmPrice(
        algorithm=BUTTERFLY, latency_s=2 * steps * link.latency_s, per_byte_s=2 * (n - 1) / n / link.bandwidth
    )


def hierarchical_all_reduce(group: GroupShape) -> AlgorithmPrice | None:
    """None unless the group spans several nodes with several of its devices on a node."""
    m, nodes, inter, intra = group.per_node, group.num_nodes, group.link, group.intra_node
    if nodes <= 1 or m <= 1:
        return None
    n = group.num_devices
    latency = (2 * (n - 1) - 2 * (nodes - 1)) * intra.latency_s + 2 * (nodes - 1) * inter.latency_s
    per_byte = 2 * (n - 1) / n / inter.bandwidth  # NCCL's node-by-node ring: the ring's bytes (module docstring)
    return AlgorithmPrice(algorithm=HIERARCHICAL, latency_s=latency, per_byte_s=per_byte)


ALGORITHMS = {
    RING: ring_all_reduce,
    TREE: tree_all_reduce,
    BUTTERFLY: butterfly_all_reduce,
    HIERARCHICAL: hierarchical_all_reduce,
}


def all_reduce_prices(num_devices: int, link: Link, *, offered: Sequence[str] | None = None) -> list[AlgorithmPrice]:
    """The price of each algorithm in ``offered`` (default: what the group's backend runs) that fits the group."""
    group = GroupShape.of(num_devices, link)
    names = OFFERED[group.backend] if offered is None else offered
    prices = [ALGORITHMS[name](group) for name in names]
    return [price for price in prices if price is not None]


def choose_all_reduce(
    num_bytes: float, *, num_devices: int, link: Link, offered: Sequence[str] | None = None
) -> AlgorithmPrice:
    """The cheapest all-reduce of ``num_bytes`` per device over the group (the ring on a tie; free at ``n = 1``)."""
    if num_devices <= 1:
        return AlgorithmPrice(algorithm=RING, latency_s=0.0, per_byte_s=0.0)
    prices = all_reduce_prices(num_devices, link, offered=(RING, *(offered or ())) if offered else None)
    return min(prices, key=lambda price: (price.seconds(num_bytes), price.algorithm != RING))


def describe_all_reduce(num_bytes: float, *, num_devices: int, link: Link) -> str:
    """``all-reduce 25.0 MiB over 64 devices on 8 nodes: tree`` (KiB below a MiB)."""
    nodes = GroupShape.of(num_devices, link).num_nodes
    chosen = choose_all_reduce(num_bytes, num_devices=num_devices, link=link).algorithm
    where = f" on {nodes} nodes" if nodes > 1 else ""
    size = f"{num_bytes / MIB:.1f} MiB" if num_bytes >= MIB else f"{num_bytes / 1024:.1f} KiB"
    return f"all-reduce {size} over {num_devices} devices{where}: {chosen}"
