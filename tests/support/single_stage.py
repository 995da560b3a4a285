"""The best one-stage plan: the intra-op ILP on every logical mesh of the devices (the tests' reference).

Each logical mesh (:func:`planner.intra.logical_meshes.logical_meshes`) is solved by
:func:`planner.intra.solve.solve_intra_op`; the cheapest that fits wins. The step time is the ILP objective
(one microbatch); its breakdown sums the explanation rows (:func:`planner.costing.stage_work.explain_stage`).
"""

from __future__ import annotations

from dataclasses import replace

from cost_models.units import GIB
from planner.costing.estimate import mfu, model_tflops_per_device
from planner.costing.setup import CostSetup
from planner.costing.stage_work import explain_stage
from planner.errors import AutoplanError
from planner.intra.logical_meshes import logical_meshes
from planner.intra.problem import MemoryBudgetError
from planner.intra.solve import IntraOpResult, solve_intra_op
from planner.intra.stage_problem import DEFAULT_OPTIONS, IntraOpOptions
from planner.intra.to_stage import stage_from_result
from planner.ir.graph import OpGraph
from planner.plan import Estimate, Stage
from planner.sharding.specs import StageMesh


def solve_best_mesh(
    graph: OpGraph, setup: CostSetup, *, devices: tuple[int, ...], options: IntraOpOptions = DEFAULT_OPTIONS
) -> tuple[IntraOpResult, list[tuple[tuple[int, ...], float | None]]]:
    """The cheapest fitting solution over the logical meshes, and each mesh's objective (None: no fit)."""
    cluster = setup.cluster
    itemsize = setup.activation_itemsize
    best: IntraOpResult | None = None
    tried: list[tuple[tuple[int, ...], float | None]] = []
    smallest = float("inf")
    for shape in logical_meshes(len(devices), cluster.devices_per_node):
        mesh = StageMesh(cluster=cluster, devices=devices, mesh_shape=shape, activation_itemsize=itemsize)
        try:
            result = solve_intra_op(graph, setup, mesh, options)
        except MemoryBudgetError as error:
            smallest = min(smallest, error.smallest_bytes)
            tried.append((shape, None))
            continue
        tried.append((shape, result.objective_s))
        if best is None or result.objective_s < best.objective_s:
            best = result
    if best is None:
        raise AutoplanError(
            f"does not fit: the smallest sharding over {len(devices)} devices needs {smallest / GIB:.1f} GiB per "
            f"device, the device has {setup.memory_budget_bytes / GIB:.1f} GiB"
        )
    return best, tried


def single_stage_plan(
    graph: OpGraph, setup: CostSetup, *, options: IntraOpOptions = DEFAULT_OPTIONS
) -> tuple[tuple[Stage, ...], Estimate, IntraOpResult]:
    devices = tuple(range(setup.cluster.num_devices))
    result, _ = solve_best_mesh(graph, setup, devices=devices, options=options)
    stage = replace(stage_from_result(result), zero=int(options.zero))
    rows = explain_stage(stage, graph, setup)
    stage = replace(stage, explanation=tuple(rows))
    step = result.objective_s * options.num_microbatches + setup.cluster.device.step_overhead_s
    estimate = Estimate(
        step_time_s=step,
        per_stage_time_s=(result.objective_s,),
        memory_per_device_bytes=int(result.memory_bytes),
        bubble_fraction=0.0,
        tflops_per_device=model_tflops_per_device(graph, step_time_s=step, num_devices=len(devices)),
        mfu=mfu(graph, setup, step_time_s=step, num_devices=len(devices)),
        breakdown_s={
            "stage_work_s": result.objective_s * options.num_microbatches,
            "host_overhead_s": setup.cluster.device.step_overhead_s,
        },
    )
    return (stage,), estimate, result
