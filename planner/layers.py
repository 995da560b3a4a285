"""Layers: runs of structurally identical blocks, so each distinct layer is solved once.

A node's *layer key* is its module path up to the first numeric component (``blocks.3`` for
``blocks.3.attn.q``); nodes without one that sit between two nodes of the same layer join it.
A layer's *structural hash* covers, for each of its nodes in order, the operator signature
and where each input comes from: a node earlier in the same layer (by position), a
parameter (by its name relative to the layer), or the k-th distinct value from outside.
Consecutive layers with equal hashes form a run.

:func:`collapse_identical_layers` maps every node of a run onto the node at the same position
in the run's first layer; planners then give all copies one decision, and a cost counted once
per mapped node is the cost of the whole run.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from planner.graph import OpGraph, OpNode, ValueKind


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
        if result and result[-1][0] == key and key is not None:
            result[-1][1].append(node)
        else:
            result.append((key, [node]))
    return result


def structural_hash(graph: OpGraph, key: str, nodes: list[OpNode]) -> str:
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
                refs.append(f"X{outside.setdefault(name, len(outside))}")
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
    for key, nodes in segments(graph):
        current = structural_hash(graph, key, nodes) if key is not None else None
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
