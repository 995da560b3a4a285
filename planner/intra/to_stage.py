"""A stage problem's choice as the plan's :class:`~planner.plan.Stage` (:func:`stage_of_choice`, a solved one:
:func:`stage_from_result`)."""

from __future__ import annotations

from planner.costing.records import record_of
from planner.intra.solve import IntraOpResult
from planner.intra.stage_problem import StageProblem
from planner.ir.graph import ValueKind
from planner.plan import NodeSharding, Stage
from planner.sharding.specs import ShardingSpec


def stage_from_result(result: IntraOpResult, *, index: int = 0) -> Stage:
    """The plan stage of a solved stage problem (:func:`stage_of_choice`)."""
    return stage_of_choice(result.stage, result.choice, index=index)


def stage_of_choice(stage: StageProblem, choice: tuple[int, ...], *, index: int = 0) -> Stage:
    """The plan stage of ``choice`` on ``stage``: every node's chosen strategy as a record, and every parameter's
    placement."""
    graph = stage.graph
    records: dict[str, NodeSharding] = {}
    by_representative: dict[str, NodeSharding] = {}
    placements: dict[str, tuple[str, ...]] = {}
    for node in graph.nodes:
        rep = stage.representative[node.name]
        if rep not in by_representative:
            by_representative[rep] = record_of(graph.node(rep), stage.strategy_of(rep, choice))
        records[node.name] = record = by_representative[rep]
        for name, spec in zip(node.inputs, record.input_specs, strict=True):
            if graph.value_kind(name) == ValueKind.PARAM and name not in placements:
                placements[name] = spec if spec is not None else ShardingSpec.replicated(stage.mesh.num_axes).placements
    for name in graph.param_names:  # parameters no node reads
        placements.setdefault(name, ShardingSpec.replicated(stage.mesh.num_axes).placements)
    return Stage(
        index=index,
        nodes=tuple(node.name for node in graph.nodes),
        devices=stage.mesh.devices,
        mesh_shape=stage.mesh.mesh_shape,
        strategies=records,
        param_placements=placements,
    )
