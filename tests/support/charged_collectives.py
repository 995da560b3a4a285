"""The collectives the cost model charges for one training step of a stage, by kind.

What the simulator prices in seconds (:func:`planner.costing.stage_work.stage_node_work`), listed as
operations from the same reading of the plan (:func:`planner.costing.stage_work.stage_strategies`:
every node's stored record as the strategy it describes, on the stage's subgraph and mesh), so an executor's
observed communication can be checked against it (``CommDebugMode`` in the tests):

* each node's own collectives (``NodeStrategy.collectives``: the record's ``forward`` and
  ``backward`` ones): the forward all-reduce of a partial sum, the backward all-reduce of a
  replicated input's gradient — per microbatch;
* resharding on each edge, from the producer's output spec to the spec the consumer needs
  (:func:`planner.sharding.specs.reshard_s`'s steps), per axis that changes: ``S→R`` an all-gather
  forward; ``R→S`` an all-gather of the gradient backward (when it needs one); ``S(d)→S(e)`` an
  all-to-all forward and backward; into ``R*`` from anything but ``R*`` also an all-reduce of the
  gradient backward; from ``R*`` to a shard no other axis splits nothing (a local slice, its gradient
  handed back partial); ``R*`` is ``R`` otherwise — per microbatch;
* the gradient sync of every parameter over the axes it is replicated on (its first reader's
  ``grad_sync_axes``), packed into buckets (:func:`planner.costing.overlap.stage_buckets`, as
  :mod:`executors.parallel.grad_sync` packs them): one all-reduce per bucket and axis, once per step (``sync``;
  ``sync_params``: one per parameter and axis, as the plan lists them).
"""

from __future__ import annotations

from collections import Counter

from cost_models.memory import optimizer_bytes
from planner.costing.overlap import stage_buckets, stage_grad_entries
from planner.costing.setup import CostSetup
from planner.costing.stage_work import stage_strategies
from planner.ir.graph import OpGraph, ValueKind
from planner.plan import Stage
from planner.sharding.specs import GATHERED, REPLICATE, ShardingSpec, locally_sliced_axes


def charged_collectives(
    stage: Stage, graph: OpGraph, setup: CostSetup, *, num_microbatches: int
) -> dict[str, Counter[str]]:
    """Per phase (``forward``, ``backward``, ``sync``): ``{"all_reduce": n, "all_gather": n, ...}`` for
    one step of ``stage`` (``graph`` at the microbatch size)."""
    context, strategies = stage_strategies(stage, graph, setup)
    local, needs_grad = context.graph, context.grad_values
    per_microbatch: dict[str, Counter[str]] = {"forward": Counter(), "backward": Counter()}
    synced: dict[str, tuple[int, ...]] = {}
    for name in stage.nodes:
        node, strategy = local.node(name), strategies[name]
        for kind, _, phase, _ in strategy.collectives:
            per_microbatch[phase][kind] += 1
        for param, axes in strategy.grad_sync_axes:
            synced.setdefault(param, axes)
        for value, need in zip(node.inputs, strategy.inputs, strict=True):
            if need is None or local.value_kind(value) != ValueKind.NODE:  # stage inputs arrive whole
                continue
            source = strategies[value].output.placements
            for phase, kind in _reshard(source, need.placements, requires_grad=value in needs_grad):
                per_microbatch[phase][kind] += 1
    result = {
        phase: Counter({k: n * num_microbatches for k, n in counts.items()}) for phase, counts in per_microbatch.items()
    }
    result["sync_params"] = Counter("all_reduce" for axes in synced.values() for _ in axes)
    grad_itemsize = optimizer_bytes(setup.optimizer).grads
    buckets = stage_buckets(stage_grad_entries(stage, graph), grad_itemsize=grad_itemsize)
    result["sync"] = Counter("all_reduce" for bucket in buckets for _ in bucket[0].axes)
    return result


def _reshard(source: tuple[str, ...], target: tuple[str, ...], *, requires_grad: bool) -> list[tuple[str, str]]:
    steps = []
    local = locally_sliced_axes(ShardingSpec(source), ShardingSpec(target))
    for axis, (before, after) in enumerate(zip(source, target, strict=True)):
        if after == GATHERED and before != GATHERED and requires_grad:  # a reader's partial gradient, reduced here
            steps.append(("backward", "all_reduce"))
        before, after = (REPLICATE if p == GATHERED else p for p in (before, after))
        if before == after or axis in local:
            continue
        if before == REPLICATE:
            steps += [("backward", "all_gather")] if requires_grad else []
        elif after == REPLICATE:
            steps.append(("forward", "all_gather"))
        else:
            steps += [("forward", "all_to_all")] + ([("backward", "all_to_all")] if requires_grad else [])
    return steps


def observed_kind(op_name: str) -> str | None:
    """CommDebugMode's collective (functional, or c10d's ``allreduce_``: the gradient buckets of
    :mod:`executors.parallel.grad_sync`) -> the cost model's kind (None: not a collective we price)."""
    for key, kind in (
        ("all_reduce", "all_reduce"),
        ("allreduce", "all_reduce"),
        ("all_gather", "all_gather"),
        ("all_to_all", "all_to_all"),
        ("reduce_scatter", "reduce_scatter"),
    ):
        if key in op_name:
            return kind
    return None
