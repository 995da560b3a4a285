"""Interleaved 1F1B and zero bubble as choices: a pipeline candidate under the schedules beyond 1F1B.

A candidate of the stage DP or a hand-written method is ``S`` stages on ``S`` device groups, run by
GPipe or 1F1B (:mod:`planner.inter.pricing`). Its *variants* keep the device groups, meshes and
layer options (the same :class:`~planner.inter.stage_pricing.StageSpec` slot) and change the schedule
(:mod:`planner.plan.schedules`):

* ``zero-bubble`` with ``v = 1``: the same stages; each backward splits into the input gradient
  ``I`` (the previous stage waits for it) and the weight gradient ``W``, which fills the bubble
  (:func:`planner.costing.stage_work.weight_grad_s`: half a matmul's backward compute);
* ``interleaved`` or ``zero-bubble`` with ``v ≥ 2``: the candidate's layers are cut again into
  ``S·v`` contiguous virtual stages of about equal time (:func:`balanced_cuts`, the linear partition
  minimising the largest part, over each layer's time in the candidate's slot), virtual stage
  ``k`` on the devices of stage ``k mod S``. The bubble shrinks about ``v`` times (Narayanan et al.
  2021 §2.2: ``(S − 1)/(v·m)`` of the ideal time) for ``v`` times the boundary transfers and the
  per-action host overhead, and the warm-up keeps more microbatches in flight.

Each variant is priced by replaying its schedule's real order in the simulator
(:func:`planner.costing.lowering.lower_stages` with :func:`planner.plan.schedules.rank_actions`): the step
time, bubble and peak memory per device of the estimate are the replay's, so for these schedules the
estimate and ``plan show``'s simulation agree by construction (there is no closed form to check).
A variant whose peak memory exceeds the budget, that torch's schedule class would refuse
(:func:`planner.plan.schedules.check_schedule`), or whose stages differ in size is not offered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from cost_models.simulator import SimResult
from cost_models.units import GIB
from planner.costing.estimate import mfu, model_tflops_per_device
from planner.costing.lowered_tasks import Lowered
from planner.costing.lowering import lower_stages, simulate_lowered
from planner.costing.setup import CostSetup
from planner.errors import AutoplanError
from planner.inter.layer_costs import SLOTS
from planner.inter.pricing import price_stages
from planner.inter.search import LayerTables, PipelineChoice, Progress
from planner.inter.stage_dp.device_blocks import assign_devices
from planner.inter.stage_pricing import PricedPipeline, StageSpec, plan_stages, price_stage
from planner.inter.stage_shapes import StageShapes
from planner.ir.graph import OpGraph
from planner.options import Method
from planner.plan import Estimate
from planner.plan.schedules import MULTI_STAGE_SCHEDULES, check_schedule, split_backward_refusal
from planner.plan.stage import sends_shards

# (schedule, virtual stages per rank) tried for each candidate; --schedule NAME keeps that name's
VARIANTS = (("zero-bubble", 1), ("interleaved", 2), ("zero-bubble", 2), ("interleaved", 4))
VARIANT_CANDIDATES = 3  # the fastest candidates of several stages (all methods together) get variants


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """What a priced pipeline was made from: enough to re-cut and re-price it."""

    setting: PipelineChoice  # its microbatch count: the graph at the microbatch size, layers, boundary table
    specs: tuple[StageSpec, ...]
    refine: bool  # re-solve stages as the search does (False: a hand-written layout stays itself)


def balanced_cuts(times: list[float], parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``(first, last)`` ranges of ``times`` whose largest sum is the smallest possible
    (the linear-partition DP, O(parts·n²)); ties keep earlier parts smaller."""
    n = len(times)
    assert 1 <= parts <= n, "at least one item per part"
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - parts + k + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j] - 1e-15:
                    best[k][j], cut[k][j] = value, i
    ranges, j = [], n
    for k in range(parts, 0, -1):
        i = cut[k][j]
        ranges.append((i, j - 1))
        j = i
    return ranges[::-1]


def variant(
    candidate: Candidate,
    *,
    full_graph: OpGraph,
    tables: LayerTables,
    schedule: str,
    virtual_stages: int,
    shapes: StageShapes,
) -> PricedPipeline | None:
    """The candidate under ``schedule`` with ``virtual_stages`` per rank, priced by replay; None if not offered."""
    if not _offered(candidate, schedule=schedule, virtual_stages=virtual_stages):
        return None
    specs, m, setup = candidate.specs, candidate.setting.num_microbatches, tables.setup
    cluster = setup.cluster
    homes = assign_devices(
        [spec.submesh for spec in specs], num_nodes=cluster.num_nodes, devices_per_node=cluster.devices_per_node
    )
    virtual = specs if virtual_stages == 1 else _cut(candidate, tables, specs[0], parts=len(specs) * virtual_stages)
    mesh_shapes = [spec.mesh_shape for spec in virtual]
    priced = [
        price_stage(
            candidate.setting.graph,
            candidate.setting.layers,
            tables,
            spec,
            devices=homes[k % len(specs)],
            m=m,
            in_flight=m,
            refine=candidate.refine,
            exact=False,
            shapes=shapes,
            index=k,
            sends_shards=sends_shards(mesh_shapes, k),
        )
        for k, spec in enumerate(virtual)
    ]
    stages = plan_stages(priced, full_graph)
    if schedule == "zero-bubble" and split_backward_refusal(candidate.setting.graph, stages) is not None:
        return None  # a parameter would get no gradient (planner.plan.schedules)
    zero = tables.options.zero
    lowered = lower_stages(stages, candidate.setting.graph, setup, num_microbatches=m, schedule=schedule, zero=zero)
    result = simulate_lowered(lowered)
    if result.max_memory_bytes > setup.memory_budget_bytes * (1 + 1e-9):
        return None
    times = _stage_times(candidate, [stage.time_s for stage in priced], virtual, homes)
    return PricedPipeline(
        stages=stages,
        estimate=_replayed_estimate(full_graph, setup, result, lowered, times=times),
        num_microbatches=m,
        schedule=schedule,
        stage_choices=tuple(stage.picked for stage in priced),
    )


def _offered(candidate: Candidate, *, schedule: str, virtual_stages: int) -> bool:
    """Whether the candidate may run ``schedule`` with ``virtual_stages`` per rank: several stages of one size,
    a schedule torch's class accepts, at least one layer per virtual stage."""
    specs, v = candidate.specs, virtual_stages
    uniform = {(spec.submesh, spec.mesh_shape, spec.slot) for spec in specs}
    if len(specs) < 2 or len(uniform) != 1:
        return False
    try:
        check_schedule(
            schedule, num_ranks=len(specs), virtual_stages=v, num_microbatches=candidate.setting.num_microbatches
        )
    except AutoplanError:
        return False
    return specs[-1].last - specs[0].first + 1 >= len(specs) * v


def _stage_times(
    candidate: Candidate,
    times: list[float],
    virtual: tuple[StageSpec, ...],
    homes: list[tuple[int, ...]],
) -> list[float]:
    """Each virtual stage's time with its boundary to the next (the search's boundary table), as pricing reports it."""
    ranks_count = len(candidate.specs)
    for k, spec in enumerate(virtual[:-1]):
        times[k] += candidate.setting.boundary_s(
            spec.last,
            spec.submesh,
            virtual[k + 1].submesh,
            ranks=[homes[k % ranks_count], homes[(k + 1) % ranks_count]],
        )
    return times


def _replayed_estimate(
    full_graph: OpGraph, setup: CostSetup, result: SimResult, lowered: Lowered, *, times: list[float]
) -> Estimate:
    """The estimate of a replayed variant: the replay's step, peak memory and bubble, the stages' ``times``."""
    step, devices, device = result.step_time_s, setup.cluster.num_devices, setup.cluster.device
    return Estimate(
        step_time_s=step,
        per_stage_time_s=tuple(times),
        memory_per_device_bytes=int(result.max_memory_bytes),
        bubble_fraction=result.bubble_fraction,
        tflops_per_device=model_tflops_per_device(full_graph, step_time_s=step, num_devices=devices),
        mfu=mfu(full_graph, setup, step_time_s=step, num_devices=devices),
        breakdown_s=replay_breakdown(
            step,
            phase_s=simulate_lowered(lowered, include_step=False).step_time_s,
            overhead_s=device.step_overhead_s,
        ),
    )


def replay_breakdown(step_s: float, *, phase_s: float, overhead_s: float) -> dict[str, float]:
    """A replayed step in non-negative parts adding up to it: the pipeline phase (the replay without the end-of-step
    tasks), then the gradient syncs and optimizer updates past it, and the host's per-step overhead."""
    after = max(0.0, step_s - phase_s)
    host = min(overhead_s, after)
    return {"pipeline_s": step_s - after, "grad_sync_and_optimizer_s": after - host, "host_overhead_s": host}


def _cut(candidate: Candidate, tables: LayerTables, template: StageSpec, *, parts: int) -> tuple[StageSpec, ...]:
    """The candidate's layers in ``parts`` virtual stages of about equal time, each with the template's options."""
    graph, layers, m = candidate.setting.graph, candidate.setting.layers, candidate.setting.num_microbatches
    first, last = candidate.specs[0].first, candidate.specs[-1].last
    times = []
    for index in range(first, last + 1):
        table = tables.get(graph, layers, layers.kinds[index], template.submesh, template.mesh_shape, m)
        option = table.options[template.slot]
        assert option is not None, f"slot {SLOTS[template.slot]} has no option"
        times.append(option.time_s)
    return tuple(replace(template, first=first + a, last=first + b) for a, b in balanced_cuts(times, parts))


def best_variant(
    candidate: Candidate, *, full_graph: OpGraph, tables: LayerTables, schedules: tuple[str, ...], shapes: StageShapes
) -> PricedPipeline | None:
    """The fastest variant whose schedule is in ``schedules`` (None if none is offered)."""
    found = [
        variant(candidate, full_graph=full_graph, tables=tables, schedule=schedule, virtual_stages=v, shapes=shapes)
        for schedule, v in VARIANTS
        if schedule in schedules
    ]
    found = [priced for priced in found if priced is not None]
    return min(found, key=lambda priced: priced.estimate.step_time_s, default=None)


# the schedules beyond 1F1B each method may use under --schedule auto: Megatron-LM's own interleaved 1F1B for its
# hand-written plans; every one for auto's "rescheduled" candidate (the fastest pipelines of every method)
METHOD_SCHEDULES = {
    "megatron": ("interleaved",),
    "uniform-pipeline": (),
    "data-parallel": (),
    "rescheduled": MULTI_STAGE_SCHEDULES,
}
Pipelines = list[tuple[PricedPipeline, Candidate]]  # a candidate's 1F1B/GPipe price and what it was made from


def price_candidates(
    candidates: list[tuple[str, Candidate]],
    *,
    full_graph: OpGraph,
    tables: LayerTables,
    progress: Progress | None,
    shapes: StageShapes | None = None,
) -> tuple[dict[str, PricedPipeline], dict[str, OpGraph], dict[str, Pipelines]]:
    """Each ``(key, candidate)`` priced exactly on whole stages (:func:`planner.inter.pricing.price_stages`): the
    fastest per key (the first of equals), its graph at the microbatch size, and every priced candidate of several
    stages per key with what it was made from (for its schedule variants)."""
    priced: dict[str, PricedPipeline] = {}
    graph_of: dict[str, OpGraph] = {}
    pipelines: dict[str, Pipelines] = {}
    for done, (key, candidate) in enumerate(candidates):
        if progress is not None:
            progress("pricing candidates", done, len(candidates))
        setting, specs = candidate.setting, list(candidate.specs)
        result = price_stages(
            setting, specs, full_graph=full_graph, tables=tables, refine=candidate.refine, shapes=shapes
        )
        if result is None:
            continue
        if len(specs) > 1:
            pipelines.setdefault(key, []).append((result, candidate))
        if key not in priced or result.estimate.step_time_s < priced[key].estimate.step_time_s:
            priced[key], graph_of[key] = result, setting.graph
    return priced, graph_of, pipelines


def method_schedules(method: str, mode: str) -> tuple[str, ...]:
    """The variant schedules ``method`` tries under ``--schedule mode`` (AutoplanError: it has none of that name)."""
    allowed = METHOD_SCHEDULES[method]
    if mode == "auto":
        return allowed
    if mode not in MULTI_STAGE_SCHEDULES:
        return ()
    if method == Method.MEGATRON and mode not in allowed:
        raise AutoplanError(
            f"--schedule {mode} is not one of this method's schedules ({', '.join(allowed)}, "
            "1f1b, gpipe): use --method auto"
        )
    return (mode,)


def best_rescheduled(
    pipelines: Pipelines,
    *,
    full_graph: OpGraph,
    tables: LayerTables,
    schedules: tuple[str, ...],
) -> tuple[PricedPipeline, Candidate] | None:
    """The fastest variant under ``schedules`` of the :data:`VARIANT_CANDIDATES` fastest ``pipelines``, its notes
    saying what it saved against the candidate it came from, and that candidate; None if none is offered."""
    if not schedules or tables.options.space == "alpa":  # Alpa searches GPipe and 1F1B only
        return None
    shapes, best = StageShapes(), None
    for base, candidate in sorted(pipelines, key=lambda entry: entry[0].estimate.step_time_s)[:VARIANT_CANDIDATES]:
        found = best_variant(candidate, full_graph=full_graph, tables=tables, schedules=schedules, shapes=shapes)
        if found is not None and (best is None or found.estimate.step_time_s < best[0].estimate.step_time_s):
            best = (
                replace(found, notes=(*found.notes, _saving_note(found, base)), estimate=_with_saving(found, base)),
                candidate,
            )
    return best


def _with_saving(chosen: PricedPipeline, other: PricedPipeline) -> Estimate:
    """The variant's estimate with what it saved against its candidate, per step and per device
    (``savings.schedule_saved_s``, ``.schedule_saved_bytes``; read by :mod:`planner.plan.choices`)."""
    a, b = chosen.estimate, other.estimate
    saved = replace(
        a.savings,
        schedule_saved_s=b.step_time_s - a.step_time_s,
        schedule_saved_bytes=float(b.memory_per_device_bytes - a.memory_per_device_bytes),
    )
    return replace(a, savings=saved)


def with_variant(
    best: PricedPipeline | None,
    found: tuple[PricedPipeline, Candidate] | None,
    *,
    mode: str,
) -> PricedPipeline | None:
    """A method's plan after its variants: under ``--schedule auto`` the faster of ``best`` and the variant, under a
    named multi-stage schedule the variant (None: the method has no pipeline under it)."""
    variant_plan = None if found is None else found[0]
    if mode in MULTI_STAGE_SCHEDULES:
        return variant_plan
    if variant_plan is None or (best is not None and best.estimate.step_time_s <= variant_plan.estimate.step_time_s):
        return best
    return variant_plan


def _saving_note(chosen: PricedPipeline, other: PricedPipeline) -> str:
    ranks = len({stage.devices for stage in chosen.stages})
    virtual = len(chosen.stages) // ranks
    a, b = chosen.estimate, other.estimate
    return (
        f"schedule {chosen.schedule} with {virtual} virtual stage{'s' if virtual > 1 else ''} per rank: step "
        f"{a.step_time_s * 1e3:.4g} ms (bubble {a.bubble_fraction:.0%}, {a.memory_per_device_bytes / GIB:.3g} GiB "
        f"per device) against {b.step_time_s * 1e3:.4g} ms (bubble {b.bubble_fraction:.0%}, "
        f"{b.memory_per_device_bytes / GIB:.3g} GiB) under {other.schedule} with {len(other.stages)} stages: "
        f"saves {(b.step_time_s - a.step_time_s) * 1e3:.3g} ms per step"
    )
