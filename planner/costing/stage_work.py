"""What one microbatch costs on each node of a plan, read from the strategies the plan stores.

The simulator judges a plan by what it *says*, not by how the planner found it. For each stage
:func:`stage_strategies` reads every node's stored record (:class:`~planner.plan.NodeSharding`)
back as the strategy the search chose (:func:`planner.costing.records.strategy_of`: nothing is
re-derived or re-chosen), and :func:`stage_node_work` prices it with the ILP's own node cost
(:func:`planner.costing.node_cost.node_cost`) plus the resharding of its inputs from their producers'
stored output specs (:func:`planner.sharding.specs.reshard_s`). A node's work is then

* ``fwd_s`` = the node cost's ``forward_s`` (its forward compute + half its own collectives) + half
  the resharding of its inputs; ``bwd_s`` = the rest (collectives and resharding have a forward and
  a backward half: the all-reduce of a row-split matmul forward, of a column-split one's input
  gradient backward). Recomputation repeats ``fwd_s`` of every node in the stage's checkpointed runs
  (``Stage.recomputed_runs``; ``recompute_s``): the one price of it, here and in the search
  (:func:`planner.intra.stage_problem.recompute_s` gives the same sum); what a node keeps for backward
  under them is ``kept_bytes`` (:func:`cost_models.memory.kept_under_recompute`, as
  :func:`planner.intra.stage_problem.kept_bytes` counts it; ``activation_bytes`` without recomputation);
* a stage run as DDP (:func:`runs_as_ddp`) has no collectives and no resharding: each rank runs its
  share of the batch on plain tensors, and its gradient all-reduce is DDP's (:mod:`planner.costing.overlap`);
* ``step_s`` = gradient sync + optimizer update, once per step; ``state_bytes`` and
  ``activation_bytes`` as the intra-op problem charges them, at the stage's ZeRO level (``Stage.zero``).

:func:`explain_stage` turns the same work into the plan's explanation rows, with the algorithm each of a node's
all-reduces runs (:func:`all_reduce_words`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from cost_models.collective_algorithms import describe_all_reduce
from cost_models.communication import DDP_BUCKET_BYTES
from cost_models.memory import KeptUnderRecompute, kept_under_recompute, saved_values
from planner.costing.node_cost import NodeCost, node_cost, strategy_context
from planner.costing.records import check_records, rule_records, strategy_of
from planner.costing.setup import CostSetup, plan_setup
from planner.ir.graph import NodeKind, OpGraph, OpNode, ValueKind, subgraph
from planner.plan import NodeSharding, Plan, Stage
from planner.plan.explain import ExplainRow
from planner.sharding.op_rules import split_label
from planner.sharding.specs import ShardingSpec, StageMesh, reshard_s
from planner.sharding.strategies import NodeStrategy, StrategyContext


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeWork:
    fwd_s: float
    bwd_s: float
    step_s: float
    state_bytes: float
    activation_bytes: float
    input_bytes: float = 0.0  # stage inputs this node reads (what recomputation keeps)
    grad_sync_s: float = 0.0  # the gradient-sync part of step_s
    compute_s: float = 0.0  # the parts of fwd_s + bwd_s, for explanations
    comm_s: float = 0.0
    reshard_s: float = 0.0
    weight_grad_s: float = 0.0  # the part of bwd_s a zero-bubble schedule defers (W): :func:`weight_grad_s`
    output_bytes: float = 0.0  # the output at its local size (kept or not)
    mask_bytes: float = 0.0  # a dropout's mask (part of activation_bytes)
    extra_bytes: float = 0.0  # pooling indices, RNN gates, attention scores (part of activation_bytes)
    kept_bytes: float = 0.0  # kept for backward under the stage's recomputation (activation_bytes without it)
    recompute_s: float = 0.0  # its forward once more in the backward, when a checkpointed run holds it
    zero_step_s: float = 0.0  # the ZeRO part of step_s beyond grad_sync_s (planner.costing.zero.param_terms)


def weight_grad_s(node: OpNode, cost: NodeCost) -> float:
    """The weight-gradient part of a node's backward, which zero-bubble schedules run apart (``W``): a matmul
    reading a parameter has two backward GEMMs of the forward's size (dX and dW), so half its backward compute;
    other operators' parameter gradients (norms, biases) are reductions too small to count, and they run with
    the input gradient (``I``). Collectives and resharding stay with ``I``: the next stage waits for them."""
    if node.kind != NodeKind.MATMUL or not node.params:
        return 0.0
    forward_compute = cost.forward_s - cost.comm_s / 2
    return max(0.0, cost.compute_s - forward_compute) / 2


def runs_as_ddp(stages: list[Stage] | tuple[Stage, ...]) -> bool:
    """Pure data parallelism, which the executor runs with DDP on plain tensors: one stage on several
    devices, every parameter replicated, at ZeRO level 0 (each stage has its own level; a level above runs
    FSDP: :func:`planner.costing.zero.runs_as_fsdp`)."""
    return len(stages) == 1 and stages[0].is_pure_data_parallel and stages[0].zero == 0


def stage_context(stage: Stage, graph: OpGraph, setup: CostSetup) -> StrategyContext:
    """The stage's subgraph on its mesh, as the intra-op problem sees it (``graph`` at the microbatch size)."""
    mesh = StageMesh(
        cluster=setup.cluster,
        devices=stage.devices,
        mesh_shape=stage.mesh_shape,
        activation_itemsize=setup.activation_itemsize,
    )
    local = subgraph(graph, list(stage.nodes))
    return strategy_context(local, setup, mesh)


def stage_strategies(stage: Stage, graph: OpGraph, setup: CostSetup) -> tuple[StrategyContext, dict[str, NodeStrategy]]:
    """The stage's context and every node's stored record read back as the strategy it describes."""
    context = stage_context(stage, graph, setup)
    return context, {node.name: strategy_of(node, stage.strategies[node.name], context) for node in context.graph.nodes}


def one_device_strategies(stage: Stage, graph: OpGraph, setup: CostSetup) -> dict[str, NodeSharding]:
    """The records of a one-device stage: every node as it is, its first (unsplit) strategy."""
    assert math.prod(stage.mesh_shape) == 1, "only a one-device stage has a single natural strategy"
    return {name: records[0] for name, records in rule_records(stage_context(stage, graph, setup)).items()}


def check_plan_strategies(plan: Plan, graph: OpGraph) -> None:
    """Raise PlanError if a stored strategy is not one the sharding rules produce (a hand-edited plan);
    ``graph`` at the plan's microbatch size."""
    setup = plan_setup(plan)
    for stage in plan.stages:
        check_records(stage, stage_context(stage, graph, setup))


def stage_node_work(
    stage: Stage, graph: OpGraph, setup: CostSetup, *, zero: object = None, ddp: bool = False
) -> dict[str, NodeWork]:
    """Node name -> its work per microbatch on ``stage`` (``graph`` at the microbatch size), at the stage's own
    ZeRO level and recomputation (``zero`` is not read); ``ddp``: the stage runs on plain tensors
    (:func:`runs_as_ddp`, or FSDP: :func:`planner.costing.zero.runs_as_fsdp`)."""
    context, chosen = stage_strategies(stage, graph, setup)
    local, mesh = context.graph, context.mesh
    saved = saved_values(local)
    kept = kept_under_recompute(local, stage.recomputed_runs())
    first_reader: dict[str, str] = {}
    for node in local.nodes:
        for value in node.inputs:
            first_reader.setdefault(value, node.name)
    work: dict[str, NodeWork] = {}
    for node in local.nodes:
        strategy = chosen[node.name]
        cost = node_cost(node, strategy, setup, mesh, saved=node.name in saved, zero=stage.zero, ddp=ddp)
        reshard = 0.0 if ddp else _reshard_in(local, mesh, node.name, strategy, chosen, context.grad_values)
        if ddp:  # each rank runs its share on plain tensors: the only collective is DDP's gradient all-reduce
            cost = replace(cost, comm_s=0.0, forward_s=cost.forward_s - cost.comm_s / 2)
        fwd_s = cost.forward_s + reshard / 2
        work[node.name] = NodeWork(
            fwd_s=fwd_s,
            bwd_s=cost.compute_s + cost.comm_s + reshard - fwd_s,
            step_s=cost.step_s,
            grad_sync_s=cost.grad_sync_s,
            state_bytes=cost.state_bytes,
            activation_bytes=cost.activation_bytes,
            input_bytes=_input_bytes(local, mesh, node.name, strategy, first_reader),
            compute_s=cost.compute_s,
            comm_s=cost.comm_s,
            reshard_s=reshard,
            weight_grad_s=weight_grad_s(node, cost),
            zero_step_s=cost.zero_step_s,
            output_bytes=cost.output_bytes,
            mask_bytes=cost.mask_bytes,
            extra_bytes=cost.extra_bytes,
            kept_bytes=cost.activation_bytes,
        )
    if stage.remat:
        _with_recomputation(work, local, mesh, kept, chosen, first_reader)
    return work


def _with_recomputation(
    work: dict[str, NodeWork],
    graph: OpGraph,
    mesh: StageMesh,
    kept: KeptUnderRecompute,
    chosen: Mapping[str, NodeStrategy],
    first_reader: Mapping[str, str],
) -> None:
    """What each node keeps and recomputes under the stage's checkpointed runs (:func:`kept_under_recompute`):
    a kept value's bytes on its producer, a kept stage input's on its first reader (at the size it reads it in),
    the masks outside the runs on their dropouts; a recomputed node's forward once more in the backward."""
    inputs: dict[str, float] = {}
    for value in kept.values:
        if graph.value_kind(value) == ValueKind.INPUT:
            reader = graph.node(first_reader[value])
            need = chosen[reader.name].inputs[reader.inputs.index(value)]
            meta = graph.value(value).meta
            inputs[reader.name] = inputs.get(reader.name, 0.0) + (
                mesh.local_bytes(meta, need) if need is not None else mesh.tensor_bytes(meta)
            )
    for name, w in work.items():
        kept_bytes = (w.output_bytes if name in kept.values else 0.0) + (w.mask_bytes if name in kept.masked else 0.0)
        kept_bytes += 0.0 if name in kept.recomputed else w.extra_bytes
        work[name] = replace(
            w, kept_bytes=kept_bytes + inputs.get(name, 0.0), recompute_s=w.fwd_s if name in kept.recomputed else 0.0
        )


def explain_stage(stage: Stage, graph: OpGraph, setup: CostSetup, *, zero: object = None) -> tuple[ExplainRow, ...]:
    """One row per node of ``stage``: its split, output spec and the seconds and bytes it costs (at the stage's
    own ZeRO level; ``zero`` is not read)."""
    work = stage_node_work(stage, graph, setup)
    mesh = stage_context(stage, graph, setup).mesh
    rows = []
    for name in stage.nodes:
        node, w, record = graph.node(name), work[name], stage.strategies[name]
        rows.append(
            ExplainRow(
                node=name,
                target=node.target,
                strategy=split_label(node, record.split),
                spec=f"[{', '.join(record.output_spec)}]",
                compute_s=w.compute_s,
                comm_s=w.comm_s,
                step_s=w.step_s,
                reshard_s=w.reshard_s,
                memory_bytes=w.state_bytes + w.activation_bytes,
                all_reduces=all_reduce_words(node, record, mesh),
            )
        )
    return tuple(rows)


def all_reduce_words(node: OpNode, record: NodeSharding, mesh: StageMesh) -> str:
    """The all-reduces ``node`` issues and the algorithm each runs (:func:`describe_all_reduce`), ``; ``-joined:
    a partial sum or an input's gradient at its size on the mesh axis, a parameter's gradient sync as the
    DDP-sized bucket it rides in (other collectives are rings: :mod:`cost_models.collective_algorithms`)."""
    words: dict[str, None] = {}
    for collective in record.collectives:
        if collective.kind != "all_reduce" or mesh.mesh_shape[collective.axis] <= 1:
            continue
        size, link = mesh.mesh_shape[collective.axis], mesh.link(collective.axis)
        if collective.phase == "sync":
            words["gradient sync " + describe_all_reduce(DDP_BUCKET_BYTES, num_devices=size, link=link)] = None
            continue
        if collective.operand is None:
            meta, placements = node.output, record.output_spec
        else:
            meta, placements = node.input_metas[collective.operand], record.input_specs[collective.operand]
        if placements is None:
            continue
        num_bytes = mesh.gathered_bytes(meta, ShardingSpec(tuple(placements)), collective.axis)
        words[f"{collective.phase} " + describe_all_reduce(num_bytes, num_devices=size, link=link)] = None
    return "; ".join(words)


def _reshard_in(
    graph: OpGraph,
    mesh: StageMesh,
    name: str,
    strategy: NodeStrategy,
    chosen: Mapping[str, NodeStrategy],
    grad: frozenset[str],
) -> float:
    """Seconds to bring the node's inputs from their producers' specs to the ones it needs."""
    total = 0.0
    node = graph.node(name)
    for position, (value, meta) in enumerate(zip(node.inputs, node.input_metas, strict=True)):
        need = strategy.inputs[position]
        if need is None or graph.value_kind(value) != ValueKind.NODE:
            continue
        total += reshard_s(chosen[value].output, need, meta, mesh, requires_grad=value in grad)
    return total


def _input_bytes(
    graph: OpGraph, mesh: StageMesh, name: str, strategy: NodeStrategy, first_reader: Mapping[str, str]
) -> float:
    """Stage inputs (values from other stages or the data) this node reads, at its local size;
    a value read by several nodes is counted by its first reader only."""
    total = 0.0
    node = graph.node(name)
    for position, value in enumerate(node.inputs):
        if graph.value_kind(value) != ValueKind.INPUT:
            continue
        if first_reader[value] != name or node.inputs.index(value) != position:
            continue
        meta, need = graph.value(value).meta, strategy.inputs[position]
        total += mesh.local_bytes(meta, need) if need is not None else mesh.tensor_bytes(meta)
    return total
