"""The collectives the cost model charges for one training step of a stage, by kind.

What :mod:`planner.costing.stage_work` prices in seconds, listed as operations from the strategies the
plan stores, so an executor's observed communication can be checked against the plan
(``CommDebugMode`` in the tests):

* each node's own collectives (the record's ``forward`` and ``backward`` collectives): the forward
  all-reduce of a partial sum, the backward all-reduce of a replicated input's gradient — per
  microbatch;
* resharding on each edge, from the producer's stored output spec to the spec the consumer's
  record names (:func:`planner.sharding.specs.reshard_s`'s steps), per axis that changes: ``S→R`` an
  all-gather forward; ``R→S`` an all-gather of the gradient backward (when it needs one);
  ``S(d)→S(e)`` an all-to-all forward and backward — per microbatch;
* the gradient sync of every parameter over the axes it is replicated on (the records' ``sync``
  collectives, the parameter's first reader's): one all-reduce per axis, once per step.
"""

from __future__ import annotations

from collections import Counter

from planner.costing.node_cost import grad_values
from planner.ir.graph import OpGraph, ValueKind, subgraph
from planner.plan import Stage
from planner.sharding.specs import REPLICATE


def charged_collectives(stage: Stage, graph: OpGraph, *, num_microbatches: int) -> dict[str, Counter[str]]:
    """Per phase (``forward``, ``backward``, ``sync``): ``{"all_reduce": n, "all_gather": n, ...}`` for
    one step of ``stage``."""
    local = subgraph(graph, list(stage.nodes))
    needs_grad = grad_values(local)
    per_microbatch: dict[str, Counter[str]] = {"forward": Counter(), "backward": Counter()}
    synced: dict[str, list[str]] = {}  # parameter -> its first reader's sync collectives
    for node in local.nodes:
        record = stage.strategies[node.name]
        for position, name in enumerate(node.inputs):
            if local.value_kind(name) == ValueKind.PARAM and name not in synced:
                synced[name] = [c.kind for c in record.collectives if c.phase == "sync" and c.operand == position]
        for collective in record.collectives:
            if collective.phase != "sync":
                per_microbatch[collective.phase][collective.kind] += 1
        for value, need in zip(node.inputs, record.input_specs, strict=True):
            if need is None or local.value_kind(value) != ValueKind.NODE:
                continue
            source = stage.strategies[value].output_spec
            for phase, kind in _reshard(tuple(source), tuple(need), requires_grad=value in needs_grad):
                per_microbatch[phase][kind] += 1
    result = {phase: Counter({k: n * num_microbatches for k, n in counts.items()})
              for phase, counts in per_microbatch.items()}  # fmt: skip
    result["sync"] = Counter(kind for kinds in synced.values() for kind in kinds)
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
