"""Why a stage is sharded as it is: one row per node with its spec and the seconds it costs.

Rows come from a solved :class:`~planner.intra_op.IntraOpResult`: the chosen strategy (which
letter or dim each mesh axis splits), the output spec, compute seconds at that split, the
node's own collectives, gradient sync and optimizer step (per step), resharding of its inputs
from their producers, and the bytes per device it keeps. :func:`stage_from_result` turns the
same result into the plan's :class:`~planner.plan.Stage`.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

from planner.graph import ValueKind
from planner.intra_op import IntraOpResult
from planner.op_rules import split_label
from planner.plan import Stage
from planner.sharding import ShardingSpec, reshard_s


@dataclass(frozen=True, kw_only=True)
class ExplainRow:
    node: str
    target: str
    strategy: str
    spec: str
    compute_s: float
    comm_s: float
    step_s: float
    reshard_s: float
    memory_bytes: float

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)


def explain_rows(result: IntraOpResult) -> list[ExplainRow]:
    stage, graph = result.stage, result.stage.graph
    grad = {p.name for p in graph.params}
    rows = []
    for node in graph.nodes:
        variable = stage.variables.index(stage.representative[node.name])
        strategy = result.strategy_of(node.name)
        cost = stage.costs[variable][result.choice[variable]]
        reshard = 0.0
        for position, (name, meta) in enumerate(zip(node.inputs, node.input_metas, strict=True)):
            need = strategy.inputs[position]
            if graph.value_kind(name) == ValueKind.NODE and need is not None:
                reshard += reshard_s(
                    result.strategy_of(name).output, need, meta, stage.mesh, requires_grad=name in grad
                )
        if node.output.is_floating and any(name in grad for name in node.inputs):
            grad.add(node.name)
        rows.append(
            ExplainRow(
                node=node.name,
                target=node.target,
                strategy=split_label(node, strategy.name),
                spec=str(strategy.output),
                compute_s=cost.compute_s,
                comm_s=cost.comm_s,
                step_s=cost.step_s,
                reshard_s=reshard,
                memory_bytes=cost.memory_bytes,
            )
        )
    return rows


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
    """The plan stage: every node's output spec and every parameter's placement."""
    stage, graph = result.stage, result.stage.graph
    shardings: dict[str, tuple[str, ...]] = {}
    placements: dict[str, tuple[str, ...]] = {}
    for node in graph.nodes:
        strategy = result.strategy_of(node.name)
        shardings[node.name] = strategy.output.placements
        representative = graph.node(stage.representative[node.name])
        by_name = dict(strategy.params)
        for own, rep in zip(node.inputs, representative.inputs, strict=True):
            if rep in by_name and own not in placements:
                placements[own] = by_name[rep].placements
    for name in graph.param_names:  # parameters no node reads
        placements.setdefault(name, ShardingSpec.replicated(stage.mesh.num_axes).placements)
    return Stage(
        index=index,
        nodes=tuple(node.name for node in graph.nodes),
        devices=stage.mesh.devices,
        mesh_shape=stage.mesh.mesh_shape,
        node_shardings=shardings,
        param_placements=placements,
    )
