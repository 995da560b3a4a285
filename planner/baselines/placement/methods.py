"""Op placements as plans: the classic device-placement baselines, run and judged by the simulator.

A placement method (:data:`PLACEMENT_METHODS`) puts every operator of the graph at the microbatch
size on one device (:mod:`planner.baselines.placement.problem`). The plan has one stage per
device that holds operators, each a ``(1,)`` mesh with everything replicated, and the
``dataflow`` schedule: ``m`` microbatches flow through the placement, each op running when its
inputs arrive (:mod:`planner.costing.lowering`). ``m`` is ``--microbatches`` when given, else the largest
power of two that divides the batch and is at most ``min(devices, 16)``
(:func:`placement_microbatches`): enough microbatches to keep every device of a chain-shaped
placement busy, as a pipeline would. Its estimate is the simulated step, since the simulator is
these methods' own cost model (RL learns from it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from cost_models.units import GIB
from planner.baselines.placement.aliasing import aliasing_refusal
from planner.baselines.placement.critical_path import critical_path_placement
from planner.baselines.placement.dataflow import simulate_assignment
from planner.baselines.placement.hash_placement import hash_placement
from planner.baselines.placement.m_etf import m_etf_placement
from planner.baselines.placement.multi_objective import multi_objective_placement
from planner.baselines.placement.problem import PlacementProblem, placement_problem
from planner.baselines.placement.rl import rl_placement
from planner.costing.estimate import mfu, model_tflops_per_device
from planner.costing.setup import CostSetup
from planner.costing.stage_work import one_device_strategies
from planner.errors import AutoplanError
from planner.inter.runnable_rows import rows_difference
from planner.inter.stage_pricing import PricedPipeline
from planner.ir.graph import OpGraph, ValueKind
from planner.ir.rebatch import MicrobatchGraphs
from planner.options import Method
from planner.plan import Estimate, Stage
from planner.plan.schedules import Schedule

PLACEMENT_METHODS: dict[str, str] = {
    "hash": "op placement round-robin over devices, first that fits (Mayer et al. 2017)",
    "critical-path": "the longest path on the fastest device, other ops least-loaded (Mayer et al. 2017)",
    "multi-objective": "per op the device with the smallest memory × load × traffic × importance (Mayer et al.)",
    "m-etf": "earliest-task-first list scheduling with memory limits (Baechi, Jeon et al. 2020)",
    "rl": "REINFORCE over group placements, reward −√(simulated step), restarts around its best "
    "(Mirhoseini et al. 2017/2018; Placeto)",
}
HEURISTICS: dict[str, Callable[[PlacementProblem], tuple[int, ...]]] = {
    "hash": hash_placement,
    "critical-path": critical_path_placement,
    "multi-objective": multi_objective_placement,
    "m-etf": m_etf_placement,
}
MAX_PLACEMENT_MICROBATCHES = 16


def placement_microbatches(batch_size: int, num_devices: int, requested: int | None) -> int:
    if requested is not None:
        if batch_size % requested:
            raise AutoplanError(f"--microbatches {requested} does not divide the batch size {batch_size}")
        return requested
    count = 1
    while count * 2 <= min(num_devices, MAX_PLACEMENT_MICROBATCHES) and batch_size % (count * 2) == 0:
        count *= 2
    return count


def run_placement(
    method: str,
    graphs: MicrobatchGraphs,
    setup: CostSetup,
    *,
    batch_size: int,
    microbatches: int | None,
    rl_budget_s: float,
    rl_iterations: int | None = None,
    seed: int = 0,
    progress: Callable[[str, int, int], None] | None = None,
) -> tuple[PricedPipeline, tuple[str, ...]]:
    """The placement of ``method`` as plan stages with its simulated estimate, and notes."""
    assert method in PLACEMENT_METHODS, method
    refusal = aliasing_refusal(graphs.full, method=method)
    if refusal is not None:
        raise AutoplanError(refusal)
    m = placement_microbatches(batch_size, setup.cluster.num_devices, microbatches)
    notes = []
    while microbatches is None and m > 1 and rows_difference(graphs, batch_size // m) is not None:
        notes.append(
            f"not {m} microbatches: the model's graph at {batch_size // m} row(s) is not its graph at the batch"
        )
        m //= 2
    graph = graphs.at(batch_size // m)
    problem = placement_problem(graph, setup, num_microbatches=m)
    notes.append(f"{m} microbatches flow through the placement (dataflow schedule)")
    if method == Method.RL:
        budget_s = rl_budget_s if rl_iterations is None else math.inf  # a fixed number of updates: reproducible
        found = rl_placement(problem, budget_s=budget_s, seed=seed, max_iterations=rl_iterations, progress=progress)
        assignment = found.assignment
        notes.append(f"rl: {found.iterations} iterations, {found.num_simulations} simulations in {found.time_s:.1f} s")
    else:
        assignment = HEURISTICS[method](problem)
    result = simulate_assignment(problem, assignment)
    if result.max_memory_bytes > setup.memory_budget_bytes:
        raise AutoplanError(
            f"does not fit: the {method} placement peaks at {result.max_memory_bytes / GIB:.1f} GiB on a device, "
            f"the device has {setup.memory_budget_bytes / GIB:.1f} GiB: add devices or lower the batch"
        )
    stages = placement_stages(graph, setup, assignment, devices=tuple(range(setup.cluster.num_devices)))
    estimate = Estimate(
        step_time_s=result.step_time_s,
        per_stage_time_s=tuple(result.busy_s[stage.devices[0]] for stage in stages),
        memory_per_device_bytes=int(result.max_memory_bytes),
        bubble_fraction=result.bubble_fraction,
        tflops_per_device=model_tflops_per_device(
            graphs.at(batch_size), step_time_s=result.step_time_s, num_devices=setup.cluster.num_devices
        ),
        mfu=mfu(graphs.at(batch_size), setup, step_time_s=result.step_time_s, num_devices=setup.cluster.num_devices),
        breakdown_s={"dataflow_replay_s": result.step_time_s},  # every operator on its device, as it runs
    )
    priced = PricedPipeline(stages=stages, estimate=estimate, num_microbatches=m, schedule=Schedule.DATAFLOW)
    return priced, tuple(notes)


def placement_stages(
    graph: OpGraph, setup: CostSetup, assignment: Sequence[int], *, devices: tuple[int, ...]
) -> tuple[Stage, ...]:
    """One replicated ``(1,)`` stage per device that holds ops, numbered by device, each node as it is
    (:func:`planner.costing.stage_work.one_device_strategies`); a parameter lives with its first reader (tied
    weights are read from there)."""
    used = sorted(set(assignment))
    index = {device: s for s, device in enumerate(used)}
    nodes: list[list[str]] = [[] for _ in used]
    params: list[dict[str, tuple[str, ...]]] = [{} for _ in used]
    placed: set[str] = set()
    for node, device in zip(graph.nodes, assignment, strict=True):
        s = index[device]
        nodes[s].append(node.name)
        for name in node.inputs:
            if graph.value_kind(name) == ValueKind.PARAM and name not in placed:
                params[s][name] = ("R",)
                placed.add(name)
    params[0].update({name: ("R",) for name in graph.param_names if name not in placed})
    stages = [
        Stage(index=s, nodes=tuple(nodes[s]), devices=(devices[device],), mesh_shape=(1,), param_placements=params[s])
        for s, device in enumerate(used)
    ]
    return tuple(replace(stage, strategies=one_device_strategies(stage, graph, setup)) for stage in stages)
