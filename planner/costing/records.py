"""A node's strategy as the plan stores it (:class:`~planner.plan.NodeSharding`), and back.

:func:`record_of` writes down what the search chose: the spec of every operand (parameters
included), the output spec, the compute split and the collectives, each naming the operand it
moves. :func:`strategy_of` reads a record back as the :class:`~planner.sharding.strategies.NodeStrategy`
the cost model prices, computing its seconds from the record alone, term by term as
:func:`planner.sharding.strategies._finish` does (on mesh axis ``a`` of ``n`` devices, α-β formulas of
:mod:`cost_models.communication`):

* ``comm_s`` = Σ forward collectives on the output + Σ per input Σ its backward collectives + Σ backward
  collectives on the output's gradient, each ``kind(bytes of its tensor local to the other axes, a)``
  (:func:`planner.sharding.strategies.own_collectives_s`, which the sharding rules price with too);
* ``grad_sync_s`` = Σ per parameter Σ sync collectives
  ``bucketed all_reduce(numel · grad itemsize / shards of its spec, a)``;
* ``params`` and ``grad_sync_axes`` from the parameter operands and their sync collectives.

So the simulator prices exactly the strategy the plan holds, never one re-derived from specs.
:func:`check_records` refuses a record that no sharding rule of its operator produces (a plan
edited by hand): its seconds would not describe what DTensor does.
"""

from __future__ import annotations

from planner.ir.graph import OpNode, ValueKind
from planner.ir.layers import collapse_identical_layers
from planner.plan import Collective, NodeSharding, PlanError, Stage
from planner.sharding.op_rules import enumerate_strategies
from planner.sharding.specs import ShardingSpec
from planner.sharding.strategies import NodeStrategy, StrategyContext, own_collectives_s


def record_of(node: OpNode, strategy: NodeStrategy) -> NodeSharding:
    """The plan's record of ``strategy`` (one of ``node``'s); nodes of identical layers share positions,
    so the record of a representative is the record of each copy."""
    position_of = {name: node.inputs.index(name) for name in node.inputs}
    collectives = [
        Collective(kind=kind, axis=axis, phase=phase, operand=operand)
        for kind, axis, phase, operand in strategy.collectives
    ]
    for name, axes in strategy.grad_sync_axes:
        collectives += [
            Collective(kind="all_reduce", axis=axis, phase="sync", operand=position_of[name]) for axis in axes
        ]
    return NodeSharding(
        split=strategy.name,
        input_specs=tuple(None if spec is None else spec.placements for spec in strategy.operands),
        output_spec=strategy.output.placements,
        compute_shards=strategy.compute_shards,
        collectives=tuple(collectives),
    )


def strategy_of(node: OpNode, record: NodeSharding, context: StrategyContext) -> NodeStrategy:
    """The strategy ``record`` describes, priced on ``context.mesh`` (see the module docstring)."""
    graph, mesh = context.graph, context.mesh
    operands = tuple(None if spec is None else ShardingSpec(tuple(spec)) for spec in record.input_specs)
    output = ShardingSpec(tuple(record.output_spec))
    by_phase: dict[str, list[Collective]] = {"forward": [], "backward": [], "sync": []}
    for collective in record.collectives:
        by_phase[collective.phase].append(collective)
    own = [(c.kind, c.axis, c.phase, c.operand) for c in record.collectives if c.phase != "sync"]
    comm_s = own_collectives_s(node, own, output=output, operands=operands, mesh=mesh)
    inputs: list[ShardingSpec | None] = []
    params: dict[str, ShardingSpec] = {}
    sync_axes: dict[str, tuple[int, ...]] = {}
    grad_sync_s = 0.0
    for position, (name, meta, spec) in enumerate(zip(node.inputs, node.input_metas, operands, strict=True)):
        kind = graph.value_kind(name)
        if kind not in (ValueKind.PARAM, ValueKind.BUFFER):
            inputs.append(spec)
            continue
        inputs.append(None)
        if kind == ValueKind.BUFFER or name in params:
            continue
        params[name] = spec if spec is not None else ShardingSpec.replicated(mesh.num_axes)
        axes = tuple(c.axis for c in by_phase["sync"] if c.operand == position)
        sync_axes[name] = axes
        if spec is not None:
            grad_bytes = meta.numel * context.grad_itemsize / spec.num_shards(mesh.mesh_shape)
            grad_sync_s += sum(mesh.grad_sync_s(grad_bytes, axis) for axis in axes)
    return NodeStrategy(
        name=record.split,
        output=output,
        inputs=tuple(inputs),
        params=tuple(params.items()),
        compute_shards=record.compute_shards,
        comm_s=comm_s,
        grad_sync_s=grad_sync_s,
        grad_sync_axes=tuple(sync_axes.items()),
        collectives=tuple(own),
        operands=operands,
    )


def rule_records(context: StrategyContext) -> dict[str, tuple[NodeSharding, ...]]:
    """Every node of ``context.graph`` -> the records of the strategies its sharding rules produce, in the
    rules' order (enumerated once per identical-layer position: a copy's records are its representative's)."""
    collapsed = collapse_identical_layers(context.graph)
    by_rep: dict[str, tuple[NodeSharding, ...]] = {}
    for node in context.graph.nodes:
        rep = collapsed.representative[node.name]
        if rep not in by_rep:
            rep_node = context.graph.node(rep)
            by_rep[rep] = tuple(record_of(rep_node, s) for s in enumerate_strategies(rep_node, context)[0])
    return {node.name: by_rep[collapsed.representative[node.name]] for node in context.graph.nodes}


def check_records(stage: Stage, context: StrategyContext) -> None:
    """Raise :class:`PlanError` naming the first node of ``stage`` (``context``: its subgraph and mesh) whose
    stored record no sharding rule of its operator produces on the stage's mesh."""
    allowed = rule_records(context)
    for node in context.graph.nodes:
        record = stage.strategies[node.name]
        if record not in allowed[node.name]:
            raise PlanError(
                f"stage {stage.index}: node {node.name} ({node.target}) has strategy {record.split!r} with input specs "
                f"{[list(s) if s is not None else None for s in record.input_specs]} and output spec "
                f"{list(record.output_spec)}, which no sharding rule produces on mesh {list(stage.mesh_shape)}: "
                "re-plan rather than edit a plan's strategies by hand"
            )
