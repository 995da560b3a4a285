"""The collectives the cost model charges for one training step of a stage, by kind.

What :mod:`planner.stage_work` prices in seconds, listed as operations, so an executor's observed
communication can be checked against the model (``CommDebugMode`` in the tests):

* each node's own collectives (``NodeStrategy.collectives``): the forward all-reduce of a partial
  sum, the backward all-reduce of a replicated input's gradient — per microbatch;
* resharding on each edge (:func:`planner.sharding.reshard_s`'s steps), per axis that changes:
  ``S→R`` an all-gather forward; ``R→S`` an all-gather of the gradient backward (when it needs
  one); ``S(d)→S(e)`` an all-to-all forward and backward — per microbatch;
* the gradient sync of every parameter over the axes it is replicated on: one all-reduce per axis,
  once per step.
"""

from __future__ import annotations

from collections import Counter

from planner.estimate import CostSetup
from planner.graph import OpGraph, ValueKind
from planner.intra_op import grad_values
from planner.layer_costs import subgraph
from planner.plan import Stage
from planner.sharding import REPLICATE
from planner.stage_work import stage_strategies


def charged_collectives(
    stage: Stage, graph: OpGraph, setup: CostSetup, *, num_microbatches: int, zero: bool = False
) -> dict[str, Counter[str]]:
    """Per phase (``forward``, ``backward``, ``sync``): ``{"all_reduce": n, "all_gather": n, ...}`` for
    one step of ``stage``."""
    strategies = stage_strategies(stage, graph, setup, num_microbatches=num_microbatches, zero=zero)
    local = subgraph(graph, list(stage.nodes))
    needs_grad = grad_values(local)
    per_microbatch: dict[str, Counter[str]] = {"forward": Counter(), "backward": Counter()}
    synced: dict[str, tuple[int, ...]] = {}
    for node in local.nodes:
        strategy = strategies[node.name]
        for kind, _, phase in strategy.collectives:
            per_microbatch[phase][kind] += 1
        for name, axes in strategy.grad_sync_axes:
            synced.setdefault(name, axes)
        for value, need in zip(node.inputs, strategy.inputs, strict=True):
            if need is None or local.value_kind(value) != ValueKind.NODE:
                continue
            source = strategies[value].output.placements
            for phase, kind in _reshard(source, need.placements, requires_grad=value in needs_grad):
                per_microbatch[phase][kind] += 1
    result = {phase: Counter({k: n * num_microbatches for k, n in counts.items()})
              for phase, counts in per_microbatch.items()}  # fmt: skip
    result["sync"] = Counter("all_reduce" for axes in synced.values() for _ in axes)
    return result


def _reshard(source: tuple[str, ...], target: tuple[str, ...], *, requires_grad: bool) -> list[tuple[str, str]]:
    steps = []
    for before, after in zip(source, target, strict=True):
        if before == after:
            continue
        if before == REPLICATE:
            steps += [("backward", "all_gather")] if requires_grad else []
        elif after == REPLICATE:
            steps.append(("forward", "all_gather"))
        else:
            steps += [("forward", "all_to_all")] + ([("backward", "all_to_all")] if requires_grad else [])
    return steps
