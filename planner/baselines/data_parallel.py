"""Pure data parallelism: every device holds the whole model and a 1/d slice of the batch.

One stage over all ``d`` devices on a 1-D mesh ``(d,)``; parameters replicated (``R``);
every node that carries the batch is sharded on dim 0 (``S(0)``), the others replicated.
The estimate is :func:`planner.estimate.data_parallel_estimate`.
"""

from __future__ import annotations

from planner.errors import AutoplanError
from planner.estimate import CostSetup, batched_values, check_fits, data_parallel_estimate
from planner.graph import OpGraph
from planner.plan import Estimate, Stage


def data_parallel_stage(graph: OpGraph, *, batch_size: int, devices: tuple[int, ...]) -> Stage:
    num_devices = len(devices)
    if batch_size % num_devices:
        larger = -(-batch_size // num_devices) * num_devices
        raise AutoplanError(
            f"batch size {batch_size} cannot be split evenly over {num_devices} data-parallel devices: "
            f"use a multiple of {num_devices} (e.g. --batch-size {larger}) or fewer devices"
        )
    batched = batched_values(graph)
    shardings = {}
    for node in graph.nodes:
        splittable = node.name in batched and node.output.shape and node.output.shape[0] % num_devices == 0
        shardings[node.name] = ("S(0)",) if splittable else ("R",)
    return Stage(
        index=0,
        nodes=tuple(node.name for node in graph.nodes),
        devices=devices,
        mesh_shape=(num_devices,),
        node_shardings=shardings,
        param_placements={name: ("R",) for name in graph.param_names},
    )


def data_parallel(graph: OpGraph, setup: CostSetup, *, batch_size: int) -> tuple[tuple[Stage, ...], Estimate]:
    """The data-parallel plan over every device of the cluster, or a clear error."""
    devices = tuple(range(setup.cluster.num_devices))
    stage = data_parallel_stage(graph, batch_size=batch_size, devices=devices)
    estimate = data_parallel_estimate(graph, setup, devices=devices)
    check_fits(estimate, setup, what=f"data parallel over {len(devices)} devices")
    return (stage,), estimate
