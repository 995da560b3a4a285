"""The boundary between consecutive pipeline stages: what crossing after a layer costs, per pair of submeshes.

The activation ``A_i`` crossing after layer ``i`` (:func:`planner.ir.layers.boundary_bytes`, each value at its dtype,
floats at the training itemsize) goes forward and the gradient ``G_i`` of its floating part comes back, each split
over ``p = min(|j|, |j'|)`` device pairs, over the intra-node link when both submeshes fit in one node and the
inter-node link otherwise (the pairs leaving one node share its NICs); the receiver then regroups it inside each node
(an all-gather over ``min(|j'|, M)`` devices), the most resharding any layout of the receiver needs
(:func:`cost_models.communication.stage_transfer_s`, ``x`` for ``A_i`` and ``G_i``)::

    b(i, j, j') = Σ_x α + (x/p)·β_link + all_gather(x·n/|j'|, n = min(|j'|, M), intra)

:func:`planner.inter.search.search_pipeline` builds the table once per microbatch count; the stage DP reads it
by submesh sizes, and every candidate's pricing (:mod:`planner.inter.pricing`,
:mod:`planner.inter.schedule_variants`) by the ranks its stages were placed on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cost_models.communication import placed_transfer_s, stage_transfer_s
from planner.costing.setup import CostSetup
from planner.inter.stage_dp.device_blocks import Submesh
from planner.ir.graph import OpGraph
from planner.ir.layers import boundary_bytes

BoundaryTable = Callable[..., float]  # b(i, sender, receiver, *, ranks, longest_direction) of boundary_table


def boundary_table(graph: OpGraph, layers: Sequence[Sequence[str]], setup: CostSetup) -> BoundaryTable:
    """``b(i, j, j')`` of the module docstring for ``graph`` at the microbatch size cut into ``layers`` (node names
    per layer, :attr:`planner.inter.search.Layering.layers`)."""
    itemsize = setup.activation_itemsize
    index = {node.name: k for k, node in enumerate(graph.nodes)}
    position = [index[names[-1]] for names in layers]
    forward = boundary_bytes(graph, activation_itemsize=itemsize)
    backward = boundary_bytes(graph, activation_itemsize=itemsize, gradients=True)
    crossing = [(forward[k], backward[k]) for k in position]
    cluster, per_node = setup.cluster, setup.cluster.devices_per_node

    def boundary_s(
        i: int,
        sender: Submesh,
        receiver: Submesh,
        *,
        ranks: tuple[tuple[int, ...], ...] = (),
        longest_direction: bool = False,
    ) -> float:
        """``ranks``: the sender's and receiver's devices once placed (the stage DP knows only their sizes);
        ``longest_direction``: the slower of the two directions alone (each has a link of its own)."""
        if ranks:
            sender_ranks, receiver_ranks = ranks
            directions = [
                placed_transfer_s(num_bytes, cluster=cluster, sender=sender_ranks, receiver=receiver_ranks)
                for num_bytes in crossing[i]
            ]
        else:
            one_node = sender.num_nodes == receiver.num_nodes == 1 and sender.size + receiver.size <= per_node
            crosses = not one_node and cluster.num_nodes > 1
            directions = [
                stage_transfer_s(
                    num_bytes,
                    cluster=cluster,
                    sender_size=sender.size,
                    receiver_size=receiver.size,
                    sender_nodes=sender.num_nodes,
                    crosses_nodes=crosses,
                )
                for num_bytes in crossing[i]
            ]
        return max(directions) if longest_direction else sum(directions)

    return boundary_s
