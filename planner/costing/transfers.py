"""Values crossing between the chunks of a lowered plan (:mod:`planner.costing.lowering`): their bytes each way
and the seconds a transfer of them takes.

* a pipeline sends everything live across a stage's last node (:func:`planner.ir.layers.boundary_bytes`) to the
  next stage, and its gradient back (:func:`pipeline_edges`);
* an op placement sends each value to every chunk that reads it, and a floating value's gradient back
  (:func:`dataflow_edges`);
* a transfer between stages costs :func:`cost_models.communication.stage_transfer_s` (a pipeline: parallel
  device pairs, then a regroup inside the receiver), between placed devices :func:`cost_models.communication.p2p_s`
  (:func:`stage_transfer`). Every value at its dtype (floating values at the activation itemsize).
"""

from __future__ import annotations

from collections.abc import Callable

from cost_models.communication import p2p_s, placed_transfer_s
from planner.costing.setup import CostSetup
from planner.ir.graph import OpGraph
from planner.ir.layers import boundary_bytes


def _value_bytes(setup: CostSetup, meta) -> float:
    itemsize = setup.activation_itemsize
    return float(meta.numel * itemsize if itemsize and meta.is_floating else meta.nbytes)


Edges = dict[tuple[int, int], float]


def pipeline_edges(graph: OpGraph, runs: list[list[int]], setup: CostSetup) -> tuple[Edges, Edges]:
    """Bytes forward and gradient bytes back across each stage boundary, every value at its dtype."""
    itemsize = setup.activation_itemsize
    forward = boundary_bytes(graph, activation_itemsize=itemsize)
    backward = boundary_bytes(graph, activation_itemsize=itemsize, gradients=True)
    cuts = [(c, run[-1]) for c, run in enumerate(runs[:-1])]
    return (
        {(c, c + 1): float(forward[k]) for c, k in cuts if forward[k] > 0},
        {(c, c + 1): float(backward[k]) for c, k in cuts if backward[k] > 0},
    )


def dataflow_edges(graph: OpGraph, runs: list[list[int]], setup: CostSetup) -> tuple[Edges, Edges]:
    chunk_of = {graph.nodes[p].name: c for c, run in enumerate(runs) for p in run}
    sent: dict[tuple[str, int], tuple[float, bool]] = {}
    for node in graph.nodes:
        for name, meta in zip(node.inputs, node.input_metas, strict=True):
            if name in chunk_of and chunk_of[name] != chunk_of[node.name]:
                sent[name, chunk_of[node.name]] = (_value_bytes(setup, meta), meta.is_floating)
    forward: Edges = {}
    backward: Edges = {}
    for (name, c), (num_bytes, floating) in sent.items():
        key = (chunk_of[name], c)
        forward[key] = forward.get(key, 0.0) + num_bytes
        if floating:
            backward[key] = backward.get(key, 0.0) + num_bytes
    return forward, backward


def stage_transfer(setup: CostSetup, devices: list[tuple[int, ...]], *, pipeline: bool) -> Callable:
    cluster = setup.cluster

    def transfer_s(a: int, b: int, num_bytes: float) -> float:
        if num_bytes <= 0:
            return 0.0
        if not pipeline:
            return p2p_s(num_bytes, link=cluster.link_between([devices[a][0], devices[b][0]]))
        return placed_transfer_s(num_bytes, cluster=cluster, sender=devices[a], receiver=devices[b])

    return transfer_s
