"""``plan --explain``: each node's split, spec and seconds as a rich table, with the algorithm each of its
all-reduces runs (ring, tree, hierarchical: :mod:`cost_models.collective_algorithms`)."""

from __future__ import annotations

from rich.table import Table

from cost_models.units import MIB
from planner.plan.explain import ExplainRow


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
        "all-reduce algorithms",
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
            f"{row.memory_bytes / MIB:.1f}",
            row.all_reduces,
        )
    table.add_section()
    totals = [
        sum(getattr(r, key) for r in rows) for key in ("compute_s", "comm_s", "step_s", "reshard_s", "memory_bytes")
    ]
    table.add_row("total", "", "", "", *(f"{t * 1e3:.3f}" for t in totals[:4]), f"{totals[4] / MIB:.1f}", "")
    return table
