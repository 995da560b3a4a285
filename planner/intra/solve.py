"""Solve one stage's intra-op problem: build it (:func:`planner.intra.stage_problem.build_stage_problem`),
seed it with the data-parallel and Megatron assignments (:mod:`planner.intra.incumbents`) and
solve the ILP (:func:`planner.intra.ilp.solve_strategy_ilp`); never worse than either incumbent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from planner.costing.setup import CostSetup
from planner.intra.ilp import solve_strategy_ilp
from planner.intra.incumbents import data_parallel_choice, megatron_choice
from planner.intra.problem import StrategySolution, evaluate
from planner.intra.stage_problem import DEFAULT_OPTIONS, IntraOpOptions, StageProblem, build_stage_problem
from planner.ir.graph import OpGraph
from planner.sharding.specs import StageMesh


@dataclass(frozen=True, kw_only=True)
class IntraOpResult:
    stage: StageProblem
    choice: tuple[int, ...]
    objective_s: float
    memory_bytes: float
    solution: StrategySolution
    incumbent_objectives_s: dict[str, float]
    build_s: float


def solve_intra_op(
    graph: OpGraph, setup: CostSetup, mesh: StageMesh, options: IntraOpOptions = DEFAULT_OPTIONS
) -> IntraOpResult:
    """Build and solve the stage ILP; raise AutoplanError (smallest memory) when nothing fits."""
    started = time.perf_counter()
    stage = build_stage_problem(graph, setup, mesh, options)
    incumbents = {"data-parallel": data_parallel_choice(stage), "megatron": megatron_choice(stage)}
    built = time.perf_counter()
    solution = solve_strategy_ilp(
        stage.problem, time_limit_s=options.time_limit_s, gap=options.gap, incumbents=list(incumbents.values())
    )
    return IntraOpResult(
        stage=stage,
        choice=solution.choice,
        objective_s=solution.objective,
        memory_bytes=solution.memory_bytes,
        solution=solution,
        incumbent_objectives_s={name: evaluate(stage.problem, choice)[0] for name, choice in incumbents.items()},
        build_s=built - started,
    )
