"""Layers: runs of structurally identical blocks, so each distinct layer is solved once.

A node's *layer key* is its module path up to the first numeric component (``blocks.3`` for
``blocks.3.attn.q``); nodes without one that sit between two nodes of the same layer join it.
A layer's *structural hash* covers, for each of its nodes in order, the operator signature
and where each input comes from: a node earlier in the same layer (by position), a
parameter (by its name relative to the layer), or the k-th distinct value from outside — and
whether that outside value needs a gradient (a first layer fed by the data communicates less in
backward than the ones after it). Consecutive layers with equal hashes form a run.

:func:`collapse_identical_layers` maps every node of a run onto the node at the same position
in the run's first layer; planners then give all copies one decision, and a cost counted once
per mapped node is the cost of the whole run.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from planner.ir.graph import OpGraph, OpNode, ValueKind, op_base_name


def layer_key(module_path: str) -> str | None:
    parts = module_path.split(".")
    for index, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: index + 1])
    return None


def layer_keys(graph: OpGraph) -> list[str | None]:
    keys = [layer_key(node.module_path) for node in graph.nodes]
    for index, key in enumerate(keys):
        if key is None and index > 0:
            following = next((k for k in keys[index + 1 :] if k is not None), None)
            if keys[index - 1] is not None and keys[index - 1] == following:
                keys[index] = following
    return keys


def segments(graph: OpGraph) -> list[tuple[str | None, list[OpNode]]]:
    """Consecutive nodes grouped by layer key, in topological order."""
    result: list[tuple[str | None, list[OpNode]]] = []
    for node, key in zip(graph.nodes, layer_keys(graph), strict=True):
        if result and result[-1][0] == key:
            result[-1][1].append(node)
        else:
            result.append((key, [node]))
    return result


def needs_grad(graph: OpGraph) -> set[str]:
    """Parameters and the floating values computed from them."""
    result = set(graph.param_names)
    for node in graph.nodes:
        if node.output.is_floating and any(name in result for name in node.inputs):
            result.add(node.name)
    return result


def structural_hash(graph: OpGraph, key: str, nodes: list[OpNode], *, grad: set[str] | None = None) -> str:
    grad = needs_grad(graph) if grad is None else grad
    position = {node.name: index for index, node in enumerate(nodes)}
    outside: dict[str, int] = {}
    digest = hashlib.sha256()
    for node in nodes:
        refs = []
        for name in node.inputs:
            if name in position:
                refs.append(f"L{position[name]}")
            elif graph.value_kind(name) == ValueKind.PARAM and name.startswith(key + "."):
                refs.append(f"P{name[len(key) :]}")
            else:
                refs.append(f"X{outside.setdefault(name, len(outside))}{'g' if name in grad else ''}")
        digest.update(f"{node.signature()}<{','.join(refs)}>;".encode())
    return digest.hexdigest()


@dataclass(frozen=True, kw_only=True)
class CollapsedGraph:
    """``representative[name]`` is the node that decides for ``name`` (itself if unique)."""

    representative: dict[str, str]
    runs: tuple[tuple[int, int], ...]  # (layers in the run, nodes per layer) of each run of ≥ 2 layers

    @property
    def unique_nodes(self) -> list[str]:
        return list(dict.fromkeys(self.representative.values()))

    def count(self, name: str) -> int:
        return sum(1 for rep in self.representative.values() if rep == name)


def collapse_identical_layers(graph: OpGraph) -> CollapsedGraph:
    representative = {node.name: node.name for node in graph.nodes}
    runs: list[tuple[int, int]] = []
    previous_hash: str | None = None
    first: list[OpNode] | None = None
    run_length = 0
    grad = needs_grad(graph)
    for key, nodes in segments(graph):
        current = structural_hash(graph, key, nodes, grad=grad) if key is not None else None
        if current is not None and current == previous_hash and first is not None:
            for node, rep in zip(nodes, first, strict=True):
                representative[node.name] = rep.name
            run_length += 1
            continue
        if run_length > 1 and first is not None:
            runs.append((run_length, len(first)))
        previous_hash, first, run_length = current, nodes, 1
    if run_length > 1 and first is not None:
        runs.append((run_length, len(first)))
    return CollapsedGraph(representative=representative, runs=tuple(runs))


def boundary_bytes(graph: OpGraph, *, activation_itemsize: int | None = None, gradients: bool = False) -> list[int]:
    """``cut[k]``: bytes of the node outputs produced by nodes 0..k and read by nodes after k.

    Graph inputs are left out: every stage can load them itself. Each value counts at its own dtype;
    ``activation_itemsize`` (2 under mixed precision) replaces the itemsize of floating values only,
    so integer tensors (token ids, masks, indices) keep theirs. ``gradients``: the bytes of the
    gradients that come back across the cut instead, floating values only (an integer tensor has none).
    """
    position = {node.name: index for index, node in enumerate(graph.nodes)}
    last_use: dict[str, int] = {}
    for index, node in enumerate(graph.nodes):
        for name in node.inputs:
            if name in position:
                last_use[name] = index
    delta = [0] * (len(graph.nodes) + 1)
    for name, last in last_use.items():
        produced = position[name]
        meta = graph.node(name).output
        if last <= produced or (gradients and not meta.is_floating):
            continue
        size = meta.numel * activation_itemsize if activation_itemsize and meta.is_floating else meta.nbytes
        delta[produced] += size
        delta[last] -= size
    cut, running = [], 0
    for index in range(len(graph.nodes)):
        running += delta[index]
        cut.append(running)
    return cut


def cluster_layers(graph: OpGraph, *, num_layers: int, tolerance: float = 0.5) -> list[list[str]]:
    """Alpa's layer clustering: contiguous layers of balanced FLOPs with little traffic between them.

    ``G(q, r) = min_k max(G(q−1, k), cut[k])`` over cuts ``k < r`` whose layer ``k+1..r`` has at
    most ``(1 + tolerance)·total/num_layers`` FLOPs: the largest activation crossing any layer
    boundary is minimised while compute stays balanced (REFERENCES.md, Alpa's search). Without
    a balanced solution the tolerance doubles until one exists.
    """
    nodes = graph.nodes
    count = len(nodes)
    num_layers = max(1, min(num_layers, count))
    flops = np.cumsum([0] + [node.flops_fwd + node.flops_bwd for node in nodes], dtype=float)
    cut = np.asarray(boundary_bytes(graph), dtype=float)
    cap = (1 + tolerance) * flops[-1] / num_layers
    best = np.full((num_layers + 1, count + 1), np.inf)
    choice = np.zeros((num_layers + 1, count + 1), dtype=int)
    best[0, 0] = 0.0
    for q in range(1, num_layers + 1):
        for r in range(q, count + 1):
            starts = np.arange(q - 1, r)
            balanced = ((flops[r] - flops[starts]) <= cap) | (flops[-1] == 0)
            boundary = np.where(starts > 0, cut[np.maximum(starts - 1, 0)], 0.0)
            values = np.where(balanced, np.maximum(best[q - 1, starts], boundary), np.inf)
            k = int(np.argmin(values))
            best[q, r], choice[q, r] = values[k], starts[k]
    if not np.isfinite(best[num_layers, count]):
        return cluster_layers(graph, num_layers=num_layers, tolerance=2 * tolerance + 1)
    bounds, r = [], count
    for q in range(num_layers, 0, -1):
        start = int(choice[q, r])
        bounds.append((start, r))
        r = start
    return [[node.name for node in nodes[a:b]] for a, b in reversed(bounds)]


def graph_layers(graph: OpGraph, *, num_layers: int = 16) -> list[list[str]]:
    """Layers from the module structure when it repeats, else by :func:`cluster_layers`; a node with
    several outputs (``lstm``'s tuple) stays in the layer of the ``getitem`` nodes that unpack it."""
    parts = segments(graph)
    if sum(1 for key, _ in parts if key is not None) >= 2:
        return keep_tuples_whole(graph, [[node.name for node in nodes] for _, nodes in parts])
    return keep_tuples_whole(graph, cluster_layers(graph, num_layers=num_layers))


def keep_tuples_whole(graph: OpGraph, layers: list[list[str]]) -> list[list[str]]:
    """Move the ``getitem`` nodes that open a layer, unpacking a tuple made in an earlier layer, into
    the last earlier layer left non-empty (an LSTM's three ``getitem`` nodes may each be a layer of their own):
    a stage boundary (always between layers) then never carries a tuple."""
    tuples = {node.name for node in graph.nodes if len(node.outputs) > 1}
    result: list[list[str]] = []
    for layer in layers:
        layer = list(layer)
        made = {name for earlier in result for name in earlier}
        while result and layer and _unpacks(graph.node(layer[0]), tuples & made):
            result[-1].append(layer.pop(0))
        if layer:
            result.append(layer)
    return result


def _unpacks(node: OpNode, tuples: set[str]) -> bool:
    return op_base_name(node.target) == "getitem" and bool(node.inputs) and node.inputs[0] in tuples
