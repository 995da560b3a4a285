"""Pure data parallelism: every device holds the whole model and a 1/d slice of the batch.

One stage over all ``d`` devices on a 1-D mesh ``(d,)``; parameters replicated (``R``). The node
specs follow the batch through the graph, so each is one that a sharding strategy of the node
(:func:`planner.sharding.op_rules.enumerate_strategies`) actually produces:

* graph inputs arrive split on dim 0 (each device loads its slice of the batch), ``S(0)``;
* in topological order, every node that carries the batch (:func:`planner.costing.estimate.batched_values`)
  takes, among its strategies whose parameter specs are all ``R`` and whose specs for its
  batch-carrying inputs equal what their producers output (no resharding), one with a split
  output, then the fewest re-split inputs (below), the most compute shards, the fewest other
  inputs to reshard and the least communication. The batch need not be dim 0: MoE's einsum
  ``nd,edf->enf`` splits ``n`` and outputs ``S(1)``;
* a batch-carrying node that no such strategy fits (an operator without a sharding rule, a
  softmax over the batch dim, a dim that does not divide) takes the replicated strategy, ``R``,
  and so does every node that does not carry the batch. When such a node's output keeps the
  rank of a split batch-carrying input and the size of its split dims (``split`` of a fused QKV),
  it has *lost* the split but still holds the batch there; so has an unsplit replicated node fed
  by a lost value. Consumers may take a lost value split as it would have been (``R`` to a split
  is a local slice), so one unruled operator does not replicate the rest of the model; a value
  whose batch dim was reduced away (a mean over the batch) is not lost and is never re-split.

The step is priced as DDP runs it (:func:`planner.costing.ddp.ddp_step`); the memory is
:func:`planner.costing.estimate.data_parallel_memory_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from planner.costing.ddp import ddp_estimate, ddp_step, fsdp_step
from planner.costing.estimate import batched_values, check_fits, data_parallel_memory_bytes
from planner.costing.node_cost import strategy_context
from planner.costing.records import record_of
from planner.costing.setup import CostSetup
from planner.costing.zero import fsdp_memory
from planner.errors import AutoplanError
from planner.ir.graph import OpGraph, OpNode
from planner.plan import Estimate, Stage
from planner.sharding.op_rules import enumerate_strategies
from planner.sharding.specs import REPLICATE, ShardingSpec, StageMesh, shard
from planner.sharding.strategies import NodeStrategy, StrategyContext, replicated_strategy


def data_parallel_stage(graph: OpGraph, setup: CostSetup, *, batch_size: int, devices: tuple[int, ...]) -> Stage:
    """The one stage of the data-parallel plan of ``graph`` (at ``batch_size``) over ``devices``."""
    num_devices = len(devices)
    check_batch(batch_size, num_devices)
    mesh = StageMesh(
        cluster=setup.cluster, devices=devices, mesh_shape=(num_devices,), activation_itemsize=setup.activation_itemsize
    )
    chosen = batch_strategies(graph, setup, mesh)
    return Stage(
        index=0,
        nodes=tuple(node.name for node in graph.nodes),
        devices=devices,
        mesh_shape=(num_devices,),
        strategies={node.name: record_of(node, chosen[node.name]) for node in graph.nodes},
        param_placements={name: (REPLICATE,) for name in graph.param_names},
    )


def check_batch(batch_size: int, num_devices: int) -> None:
    if batch_size % num_devices:
        larger = -(-batch_size // num_devices) * num_devices
        raise AutoplanError(
            f"batch size {batch_size} cannot be split evenly over {num_devices} data-parallel devices: "
            f"use a multiple of {num_devices} (e.g. --batch-size {larger}) or fewer devices"
        )


def batch_strategies(graph: OpGraph, setup: CostSetup, mesh: StageMesh) -> dict[str, NodeStrategy]:
    """Node name -> its strategy when the batch is split over every axis of ``mesh``."""
    context = strategy_context(graph, setup, mesh)
    flow = _BatchFlow(
        specs={value.name: _input_spec(value.meta.shape, mesh) for value in graph.inputs},
        batched=batched_values(graph),
    )
    chosen: dict[str, NodeStrategy] = {}
    for node in graph.nodes:
        strategy = _batch_strategy(node, context, flow) if node.name in flow.batched else None
        fallback = strategy is None
        if strategy is None:
            strategy = replicated_strategy(node, context)
        flow.specs[node.name] = strategy.output
        chosen[node.name] = strategy
        whole = node.name in flow.batched and _unsplit(strategy.output) and strategy.compute_shards == 1
        if whole and (fallback or flow.lost.keys() & set(node.inputs)):
            split = _lost_split(node, flow, mesh)
            if split is not None:
                flow.lost[node.name] = split
    return chosen


@dataclass(frozen=True, slots=True)
class _BatchFlow:
    """What :func:`batch_strategies`' walk knows so far, node by node."""

    specs: dict[str, ShardingSpec]  # each value's spec
    batched: set[str]  # the values that carry the batch
    lost: dict[str, ShardingSpec] = field(default_factory=dict)  # replicated values that lost their split -> it


def _input_spec(shape: tuple[int, ...], mesh: StageMesh) -> ShardingSpec:
    """A graph input's slice of the batch (dim 0) on every axis, when it divides."""
    spec = ShardingSpec(tuple(shard(0) for _ in mesh.mesh_shape))
    return spec if shape and spec.fits(shape, mesh.mesh_shape) else ShardingSpec.replicated(mesh.num_axes)


def _lost_split(node: OpNode, flow: _BatchFlow, mesh: StageMesh) -> ShardingSpec | None:
    """The split a replicated node's output would have: that of its first split batch-carrying
    input of the same rank and the same size on the split dims, if any."""
    shape = node.output.shape
    for value, meta in zip(node.inputs, node.input_metas, strict=True):
        spec = flow.lost.get(value, flow.specs.get(value))
        if value not in flow.batched or spec is None or _unsplit(spec) or len(meta.shape) != len(shape):
            continue
        dims = spec.shards_per_dim(mesh.mesh_shape)
        if all(meta.shape[dim] == shape[dim] for dim in dims) and spec.fits(shape, mesh.mesh_shape):
            return spec
    return None


def _batch_strategy(node: OpNode, context: StrategyContext, flow: _BatchFlow) -> NodeStrategy | None:
    """The best strategy that keeps the parameters replicated and the batch where it arrives, if any."""
    replicated = ShardingSpec.replicated(context.mesh.num_axes)
    ranked = []
    for strategy in enumerate_strategies(node, context)[0]:
        if all(spec == replicated for _, spec in strategy.params):
            rank = _rank(node, strategy, flow)
            if rank is not None:
                ranked.append((rank, strategy))
    return min(ranked, key=lambda row: row[0])[1] if ranked else None


def _rank(node: OpNode, strategy: NodeStrategy, flow: _BatchFlow) -> tuple[bool, int, int, int, float] | None:
    """Sort key of ``strategy`` (smaller is better); None if it reshards a batch-carrying input
    other than by splitting a lost one as it would have been."""
    resplit = other = 0
    for value, need in zip(node.inputs, strategy.inputs, strict=True):
        if need is None or value not in flow.specs or need == flow.specs[value]:
            continue
        if flow.lost.get(value) == need:
            resplit += 1
        elif value in flow.batched:
            return None
        else:
            other += 1
    return (_unsplit(strategy.output), resplit, -strategy.compute_shards, other, strategy.comm_s)


def _unsplit(spec: ShardingSpec) -> bool:
    return all(placement == REPLICATE for placement in spec.placements)


def data_parallel(
    graph: OpGraph, setup: CostSetup, *, batch_size: int, check: bool = True
) -> tuple[tuple[Stage, ...], Estimate]:
    """The data-parallel plan over every device of the cluster, priced as DDP runs it
    (:func:`planner.costing.ddp.ddp_step`, the price of every one-stage data-parallel plan), or a
    clear error. ``check=False``: no "does not fit" here (a plan that runs under ZeRO is checked by
    :func:`with_zero`, on the memory it shards)."""
    devices = tuple(range(setup.cluster.num_devices))
    stage = data_parallel_stage(graph, setup, batch_size=batch_size, devices=devices)
    memory = data_parallel_memory_bytes(graph, setup, num_devices=len(devices))
    estimate = ddp_estimate(graph, setup, ddp_step(stage, graph, setup, m=1), memory_bytes=memory)
    if check:
        check_fits(estimate, setup, what=f"data parallel over {len(devices)} devices")
    return (stage,), estimate


def with_zero(
    stages: tuple[Stage, ...], estimate: Estimate, graph: OpGraph, setup: CostSetup, *, level: int, check: bool = True
) -> tuple[tuple[Stage, ...], Estimate]:
    """The data-parallel plan run under FSDP at ZeRO ``level`` (:mod:`planner.costing.zero`; ``graph`` the whole
    batch's): priced as it runs (:func:`planner.costing.ddp.fsdp_step`), its memory as FSDP holds it
    (:func:`planner.costing.zero.fsdp_memory`), refused when that does not fit (``check``)."""
    (stage,) = stages
    devices = len(stage.devices)
    if level == 0 or devices == 1:
        if check:
            check_fits(estimate, setup, what=f"data parallel over {devices} devices")
        return stages, estimate
    stage = replace(stage, zero=level)
    memory = fsdp_memory(stage, graph, setup).total_bytes
    fsdp = ddp_estimate(graph, setup, fsdp_step(stage, graph, setup, m=1), memory_bytes=memory)
    if check:
        check_fits(fsdp, setup, what=f"data parallel over {devices} devices under ZeRO-{level} (FSDP)")
    return (stage,), fsdp
