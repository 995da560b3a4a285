"""The data-parallel plan with CPU offload under FSDP (``--offload``): the plan of last resort for memory.

:func:`offloaded_data_parallel` is the one-microbatch data-parallel plan
(:func:`planner.baselines.data_parallel.data_parallel`) run under FSDP with torch's ``CPUOffloadPolicy`` at the
fastest ZeRO level of ``--zero`` (auto: 1, 2 or 3) that fits, its devices' shards in the node's host memory
(:func:`planner.costing.offload.host_bytes`)
(:func:`planner.inter.data_parallel_levels.best_offloaded_level`), each level priced as it runs
(:func:`planner.costing.ddp.fsdp_step`, :func:`planner.costing.zero.fsdp_memory`; what offload changes:
:mod:`planner.costing.offload`). Its stage line says what offload saved in memory and what it cost in time
against the fastest level without it.

:func:`with_offload` is the one rule for when a plan offloads (``auto``'s candidates and ``--method
data-parallel`` alike): ``--offload on``, always (the offloaded plan is the only candidate); ``auto``, only when no
candidate fits without it — offload never saves time, so a plan that fits is never replaced and every estimate of a
model that fits stays what it was; ``off``, never. Under ``auto`` the plan is also refused when any of its levels
fits without offload (the data-parallel candidates do not try every level under ``--zero auto``; that level, not
offload, is what such a plan lacks).
"""

from __future__ import annotations

import math
from dataclasses import replace

from cost_models.units import GIB
from planner.baselines.data_parallel import data_parallel
from planner.costing.ddp import ddp_estimate, ddp_step, fsdp_step
from planner.costing.offload import host_bytes
from planner.costing.plan_memory import sharded_stage_memory
from planner.costing.zero import fsdp_memory
from planner.errors import AutoplanError
from planner.inter.data_parallel_levels import best_offloaded_level
from planner.inter.planning_input import PlanningInput
from planner.inter.stage_pricing import PricedPipeline
from planner.options import OffloadChoice, RematChoice, ScheduleChoice
from planner.plan.schedules import Schedule


def with_offload(fitting: PricedPipeline | None, inputs: PlanningInput) -> PricedPipeline | None:
    """The plan under the ``--offload`` rule (module docstring): ``fitting`` (the best plan without offload, None
    when none fits) or the offloaded data-parallel plan (None when that does not fit either)."""
    choice = inputs.options.offload
    if choice == OffloadChoice.OFF or (choice == OffloadChoice.AUTO and fitting is not None):
        return fitting
    return offloaded_data_parallel(inputs)


def offload_hint(inputs: PlanningInput) -> str:
    """Under ``--offload off``, when the offloaded data-parallel plan would fit: the clause saying so (else "")."""
    if inputs.options.offload != OffloadChoice.OFF or str(inputs.options.zero) == "0":
        return ""
    found = offloaded_data_parallel(replace(inputs, options=replace(inputs.options, offload=OffloadChoice.AUTO)))
    if found is None:
        return ""
    (stage,) = found.stages
    return (
        f"; CPU offload fits it (ZeRO-{stage.zero} with the shards in host memory, "
        f"{found.estimate.memory_per_device_bytes / GIB:.1f} GiB per device, step {found.estimate.step_time_s:.3g} s): "
        "drop --offload off"
    )


def offloaded_data_parallel(inputs: PlanningInput) -> PricedPipeline | None:
    """The one-microbatch data-parallel plan under FSDP with CPU offload at its fastest fitting ZeRO level; None when
    the options rule it out (recomputation, microbatches, a schedule, degrees, ``--zero 0``), when nothing fits, or
    under ``--offload auto`` when the plan fits at some level without offload (offload is then not needed)."""
    graph, setup, options = inputs.full_graph, inputs.setup, inputs.options
    plain = options.remat in (RematChoice.AUTO, RematChoice.OFF, RematChoice.OFF_OR_FULL)
    if not plain or options.microbatches not in (None, 1) or options.schedule != ScheduleChoice.AUTO:
        return None
    if options.degrees is not None or str(options.zero) == "0":
        return None
    try:  # a batch the devices cannot split, a layout the replicas cannot run
        (stage,), _ = data_parallel(graph, setup, batch_size=inputs.graphs.batch_size, check=False)
    except AutoplanError:
        return None
    if not stage.is_pure_data_parallel:  # FSDP shards whole replicated parameters
        return None

    def step_at(level: int, offload: bool) -> float:
        at = replace(stage, zero=level, offload=offload)
        return (fsdp_step(at, graph, setup, m=1) if level else ddp_step(at, graph, setup, m=1)).step_s

    def memory_at(level: int, offload: bool) -> float:
        at = replace(stage, zero=level, offload=offload)
        if offload and host_bytes(at, graph, setup) > setup.cluster.host().host_memory_bytes:
            return math.inf  # the node's DRAM cannot hold its devices' shards
        if level:
            return fsdp_memory(at, graph, setup).total_bytes
        data = frozenset(value.name for value in graph.inputs)
        found = sharded_stage_memory(
            at, graph, setup, in_flight=1, num_microbatches=1, last=True, data_inputs=data, ddp=True
        )
        return found.total_bytes

    needed = options.offload == OffloadChoice.AUTO  # auto: only when no level fits without it
    found = best_offloaded_level(
        stage, setup, zero=options.zero, step_at=step_at, memory_at=memory_at, only_if_needed=needed
    )
    if found is None:
        return None
    chosen, line = found
    best = replace(stage, zero=chosen.level, offload=True, memory_saving=line)
    estimate = ddp_estimate(graph, setup, fsdp_step(best, graph, setup, m=1), memory_bytes=chosen.memory_bytes)
    return PricedPipeline(stages=(best,), estimate=estimate, num_microbatches=1, schedule=Schedule.NONE)
