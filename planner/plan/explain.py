"""Why a node is sharded as it is: one explanation row per node, stored in the plan's stage.

:func:`planner.costing.stage_work.explain_stage` fills the rows from the strategies a stage stores, priced
by the same cost model as the estimate: the split (which letter or dim each mesh axis splits), the
output spec, compute seconds at that split, the node's own collectives, gradient sync and optimizer
step (per step), resharding of its inputs from their producers, the bytes per device it keeps, and the
algorithm each of its all-reduces runs (``all_reduces``, :mod:`cost_models.collective_algorithms`).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.plan.codec import JsonCoded


@dataclass(frozen=True, kw_only=True)
class ExplainRow(JsonCoded):
    """Why one node is sharded as it is: its split and output spec, and what it costs at them (seconds per
    microbatch, ``step_s`` per step; bytes per device)."""

    node: str
    target: str
    strategy: str
    spec: str
    compute_s: float
    comm_s: float
    step_s: float
    reshard_s: float
    memory_bytes: float
    all_reduces: str = ""  # "gradient sync all-reduce 25.0 MiB over 1024 devices on 128 nodes: tree; ..."
