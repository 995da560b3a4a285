"""An op placement as a task graph under the ``dataflow`` schedule, for the simulator.

Each device of a :class:`~planner.baselines.placement.problem.PlacementProblem` is one stage;
consecutive ops on a device form a chunk (:func:`planner.costing.lowering.chunks_of`), every
crossing edge is its own transfer (:attr:`PlacementProblem.transfer_s`), and each device runs
whichever of its tasks became ready first (:mod:`planner.costing.lowering`'s dataflow order).
:func:`simulate_assignment` judges an op→device assignment without building a plan (the RL reward).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from cost_models.simulator import SimResult
from planner.baselines.placement.problem import PlacementProblem, check_assignment
from planner.costing.lowered_tasks import Chunk, Lowered
from planner.costing.lowering import chunks_of, simulate_lowered
from planner.plan.schedules import Schedule


def lower_assignment(problem: PlacementProblem, assignment: Sequence[int]) -> Lowered:
    """An op placement under the dataflow schedule: one stage per device of the problem."""
    check_assignment(problem, assignment)
    runs = chunks_of(assignment)
    chunk_of = {op: c for c, run in enumerate(runs) for op in run}
    chunks = []
    for run in runs:
        speed = problem.device_speed[assignment[run[0]]]
        chunks.append(
            Chunk(
                stage=assignment[run[0]],
                fwd_s=math.fsum(problem.fwd_s[o] for o in run) / speed,
                bwd_s=math.fsum(problem.bwd_s[o] for o in run) / speed,
                activation_bytes=math.fsum(problem.activation_bytes[o] for o in run),
            )
        )
    edges: dict[tuple[int, int], float] = {}
    for u, v, num_bytes in problem.edges:
        key = (chunk_of[u], chunk_of[v])
        if key[0] != key[1]:
            edges[key] = edges.get(key, 0.0) + num_bytes
    devices = range(problem.num_devices)
    return Lowered(
        num_devices=problem.num_devices,
        stage_devices=tuple((d,) for d in devices),
        state_bytes=tuple(
            math.fsum(problem.state_bytes[o] for o, a in enumerate(assignment) if a == d) for d in devices
        ),
        step_s=tuple(
            math.fsum(problem.step_s[o] for o, a in enumerate(assignment) if a == d) / problem.device_speed[d]
            + problem.step_overhead_s
            for d in devices
        ),
        chunks=tuple(chunks),
        edges=edges,
        grad_edges=edges,  # the placement problem prices a crossing value's gradient as the value
        schedule=Schedule.DATAFLOW,
        num_microbatches=problem.num_microbatches,
        transfer_s=problem.transfer_s,
    )


def simulate_assignment(problem: PlacementProblem, assignment: Sequence[int], *, record: bool = False) -> SimResult:
    return simulate_lowered(lower_assignment(problem, assignment), record=record)
