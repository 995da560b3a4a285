"""A solved stage as the plan's :class:`~planner.plan.Stage` (:func:`stage_from_result`), and the
explanation table ``plan --explain`` prints (:func:`explain_table`)."""

from __future__ import annotations

from rich.table import Table

from planner.explain_row import ExplainRow
from planner.graph import ValueKind
from planner.intra_op import IntraOpResult
from planner.plan import NodeSharding, Stage
from planner.sharding import ShardingSpec
from planner.strategy_records import record_of


def explain_table(rows: list[ExplainRow], *, title: str) -> Table:
    table = Table(title=title)
    for column in (
        "node",
        "target",
        "split",
        "output spec",
        "compute ms",
        "comm ms",
        "sync+opt ms",
        "reshard ms",
        "MiB",
    ):
        table.add_column(column, justify="right" if column.endswith(("ms", "MiB")) else "left")
    for row in rows:
        table.add_row(
            row.node,
            row.target,
            row.strategy,
            row.spec,
            f"{row.compute_s * 1e3:.3f}",
            f"{row.comm_s * 1e3:.3f}",
            f"{row.step_s * 1e3:.3f}",
            f"{row.reshard_s * 1e3:.3f}",
            f"{row.memory_bytes / 2**20:.1f}",
        )
    table.add_section()
    totals = [
        sum(getattr(r, key) for r in rows) for key in ("compute_s", "comm_s", "step_s", "reshard_s", "memory_bytes")
    ]
    table.add_row("total", "", "", "", *(f"{t * 1e3:.3f}" for t in totals[:4]), f"{totals[4] / 2**20:.1f}")
    return table


def stage_from_result(result: IntraOpResult, *, index: int = 0) -> Stage:
    """The plan stage: every node's chosen strategy as a record, and every parameter's placement."""
    stage, graph = result.stage, result.stage.graph
    records: dict[str, NodeSharding] = {}
    by_representative: dict[str, NodeSharding] = {}
    placements: dict[str, tuple[str, ...]] = {}
    for node in graph.nodes:
        rep = stage.representative[node.name]
        if rep not in by_representative:
            by_representative[rep] = record_of(graph.node(rep), result.strategy_of(rep))
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
