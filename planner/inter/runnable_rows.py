"""The rows a plan's program runs at once, and the refusal of a plan whose model has another graph there.

When a plan runs, each rank rebuilds the model's graph at the rows it computes at once
(:meth:`executors.session.Workload.graph_at`): a one-stage plan whose parameters are all replicated (DDP, or FSDP at a
ZeRO level: :attr:`planner.plan.Plan.is_pure_data_parallel`) at ``B/(m·d)`` rows per replica and microbatch, every other
plan at its microbatch, ``B/m`` rows (:func:`runtime_rows`). The plan names the operators of the graph captured at
the batch ``B``; a rank can run them only when its graph has the same operators. torch.export specialises a
dimension of size 1, so some models have another graph at one row (Hugging Face GPT-2, Falcon and Llama: one
``expand`` fewer). :func:`rows_refusal` finds that at planning time, from the planner's own captures
(:class:`planner.ir.rebatch.MicrobatchGraphs`: a size not captured yet is captured once), and says what to change.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.ir.graph import node_difference
from planner.ir.rebatch import MicrobatchGraphs
from planner.plan import Stage


def runtime_rows(*, stages: Sequence[Stage], num_microbatches: int, batch_size: int) -> tuple[int, str]:
    """The rows one rank's graph is captured at when the plan runs, and what holds them."""
    rows = batch_size // num_microbatches
    if len(stages) == 1 and stages[0].is_pure_data_parallel:
        return rows // len(stages[0].devices), "replica and microbatch"
    return rows, "microbatch"


def rows_refusal(*, stages: Sequence[Stage], num_microbatches: int, graphs: MicrobatchGraphs, what: str) -> str | None:
    """Why the plan cannot run (its ranks' graph has other operators than the plan's), or None when it can."""
    rows, holder = runtime_rows(stages=stages, num_microbatches=num_microbatches, batch_size=graphs.batch_size)
    difference = rows_difference(graphs, rows)
    if difference is None:
        return None
    return (
        f"{what} runs {rows} row(s) of the batch per {holder}, and this model's graph at {rows} row(s) is not its "
        f"graph at {graphs.batch_size} ({difference}; torch.export specialises dimensions of size 1), so the "
        f"ranks could not run the plan's operators: give each {holder} at least {2 * rows} rows (a larger "
        "--batch-size, fewer devices or fewer --microbatches)"
    )


def rows_difference(graphs: MicrobatchGraphs, rows: int) -> str | None:
    """How the graph at ``rows`` differs from the graph at the batch (None: the same operators)."""
    if rows == graphs.batch_size:
        return None
    return node_difference(graphs.full, graphs.at(rows))
