"""Which runs of nodes a stage recomputes in backward instead of keeping their activations.

A *run* is a tuple of consecutive nodes (graph order) that the executor wraps in one activation
checkpoint (``torch.utils.checkpoint``): forward keeps only what enters the run, and backward runs the
run's forward again before its own backward. Two kinds (:class:`planner.plan.stage.Remat`):

* ``attention`` — :func:`attention_cores`: each attention core, from the score matmul ``Q·Kᵀ`` through
  the mask, softmax and dropout to the matmul with ``V`` (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", §5 selective recomputation): the ``s²``-sized
  tensors are recomputed, the projections' activations kept. A fused attention operator already keeps
  no ``s²`` tensor (FlashAttention), so it is no core;
* ``full`` — :func:`layer_runs`: every layer, keeping only its inputs (Megatron's full recomputation,
  one checkpoint per layer).

A batch-statistics operator (batch normalization) is never inside a run: recomputing it would update
its running statistics twice. Costs are in :mod:`cost_models.memory` (bytes kept) and
:func:`planner.intra.stage_problem.recompute_s` (seconds).
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.ir.graph import NodeKind, OpGraph, OpNode, ValueKind
from planner.ir.op_kinds import BATCH_STATISTICS

REMAT_KINDS = ("none", "attention", "full")
_PASS_THROUGH = (NodeKind.ELEMENTWISE, NodeKind.VIEW)  # between a core's matmuls: scale, mask, dropout, views
_MAX_STEPS = 8


def remat_runs(
    kind: str, graph: OpGraph, nodes: Sequence[str], *, layers: Sequence[Sequence[str]] = ()
) -> tuple[tuple[str, ...], ...]:
    """The runs of ``nodes`` (a stage's, in graph order) that recomputation ``kind`` checkpoints; ``layers``:
    the stage's layers (node names each) for ``full`` (one run for the whole stage without them)."""
    assert kind in REMAT_KINDS, kind
    if kind == "none":
        return ()
    if kind == "attention":
        return attention_cores(graph, nodes)
    return layer_runs(graph, nodes, layers=layers or (tuple(nodes),))


def layer_runs(graph: OpGraph, nodes: Sequence[str], *, layers: Sequence[Sequence[str]]) -> tuple[tuple[str, ...], ...]:
    """One run per layer (its nodes among ``nodes``), split around batch-statistics operators."""
    chosen = set(nodes)
    runs: list[tuple[str, ...]] = []
    for layer in layers:
        current: list[str] = []
        for name in (name for name in nodes if name in set(layer) & chosen):
            if graph.node(name).op_name in BATCH_STATISTICS:
                runs.append(tuple(current))
                current = []
            else:
                current.append(name)
        runs.append(tuple(current))
    return tuple(run for run in runs if run)


def attention_cores(graph: OpGraph, nodes: Sequence[str]) -> tuple[tuple[str, ...], ...]:
    """Each softmax's core: the nodes of ``nodes`` from the matmul making its scores to the matmul reading its
    probabilities (graph order, every node between them included); overlapping cores merge."""
    order = list(nodes)
    position = {name: index for index, name in enumerate(order)}
    readers: dict[str, list[OpNode]] = {}
    for node in graph.nodes:
        for value in node.inputs:
            readers.setdefault(value, []).append(node)
    spans: list[tuple[int, int]] = []
    for name in order:
        node = graph.node(name)
        if node.kind != NodeKind.SOFTMAX:
            continue
        first, last = _scores_matmul(graph, node), _values_matmul(node, readers)
        if first is None or last is None or first not in position or last not in position:
            continue
        spans.append((position[first], position[last]))
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    runs = [tuple(order[start : end + 1]) for start, end in merged]
    return tuple(run for run in runs if not any(graph.node(n).op_name in BATCH_STATISTICS for n in run))


def _scores_matmul(graph: OpGraph, softmax: OpNode) -> str | None:
    """Back from the softmax through same-shaped elementwise and view nodes to the matmul that made its scores."""
    current = softmax
    for _ in range(_MAX_STEPS):
        sources = [
            graph.node(value)
            for value in current.inputs
            if graph.value_kind(value) == ValueKind.NODE and graph.node(value).output.shape == softmax.output.shape
        ]
        if not sources:
            return None
        current = sources[0]
        if current.kind == NodeKind.MATMUL:
            return current.name
        if current.kind not in _PASS_THROUGH:
            return None
    return None


def _values_matmul(softmax: OpNode, readers: dict[str, list[OpNode]]) -> str | None:
    """Forward from the softmax through elementwise and view nodes (dropout) to the matmul reading the probabilities."""
    current = softmax
    for _ in range(_MAX_STEPS):
        following = readers.get(current.name, [])
        matmul = next((node for node in following if node.kind == NodeKind.MATMUL), None)
        if matmul is not None:
            return matmul.name
        passing = [node for node in following if node.kind in _PASS_THROUGH]
        if len(following) != 1 or not passing:
            return None
        current = passing[0]
    return None
