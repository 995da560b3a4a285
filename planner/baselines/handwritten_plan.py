"""``--method megatron`` and ``--method uniform-pipeline`` run alone: only the layer tables they read.

Inside ``auto`` these methods are candidates priced after the whole search (every submesh, logical
mesh and slot, :func:`planner.inter.search.search_pipeline`). Run alone, a hand-written method
reads a sliver of that: :func:`handwritten_plan` builds, per microbatch count, the span options of
its own submeshes and logical meshes only (:func:`mesh_choices_of`):

* ``megatron`` ``(t, p, d)``: the submesh of ``t·d`` devices, mesh ``(d, t)``, solving only the
  ``megatron`` slot (``data-parallel`` when ``t = 1``) with and without recomputation — one table
  per layer kind, whatever the device count, and no Lagrangian solves
  (:class:`planner.inter.search.LayerTables` ``sources``); the grid (no ``--degrees``) reads
  one submesh and mesh per grid point;
* ``uniform-pipeline``: the submeshes ``D/p`` with every logical mesh and slot.

Candidates are scored and priced exactly as inside auto (:func:`planner.baselines.handwritten.best_handwritten`,
:func:`planner.inter.pricing.price_stages` without refinement), sharing stage problems by shape
(:class:`planner.inter.stage_shapes.StageShapes`), so the plan is the one ``auto``'s candidate list
holds for that method (a test checks it). On a large cluster the grid without ``--degrees`` runs as
:func:`megatron_at_scale`: each ``(t, p, d)`` whose model state can fit (a lower bound, so the pruning loses
nothing) with its own counts down to one row per replica, on whole model layers.

Microbatch counts are :func:`planner.inter.search.microbatch_counts`
(with ``--degrees``, up to one row per replica per microbatch). With ``--degrees`` deeper than
:data:`planner.inter.search.MAX_LAYERS` stages, layers are not grouped, so each stage holds whole
model layers (Megatron's cut is among :func:`planner.baselines.handwritten.equal_spans`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from cost_models.memory import model_state_bytes, zero_shards
from planner.baselines.data_parallel import check_batch, data_parallel, with_zero
from planner.baselines.handwritten import HANDWRITTEN, best_handwritten, grid_points, least_memory, memory_parts
from planner.baselines.handwritten import Candidate as GridCandidate
from planner.baselines.method_options import MemoryParts
from planner.baselines.offloaded import with_offload
from planner.costing.estimate import ddp_bucket_bytes
from planner.costing.setup import CostSetup
from planner.costing.zero import runs_as_fsdp
from planner.errors import AutoplanError
from planner.inter.data_parallel_step import reprice_data_parallel
from planner.inter.planning_input import PlanningInput
from planner.inter.schedule_variants import (
    Candidate,
    best_rescheduled,
    method_schedules,
    price_candidates,
    with_variant,
)
from planner.inter.search import (
    MAX_LAYERS,
    CountLayout,
    LayerTables,
    MeshChoices,
    PipelineChoice,
    count_layout,
    layering,
    mesh_choices,
    microbatch_counts,
    option_arrays,
    pipeline_schedule,
)
from planner.inter.stage_pricing import PricedPipeline
from planner.inter.stage_shapes import StageShapes
from planner.ir.graph import OpGraph
from planner.options import Method, PlanOptions, ScheduleChoice
from planner.plan.schedules import Schedule

KEEP = 3  # candidates priced exactly, as auto prices them (best_handwritten's keep)


@dataclass(frozen=True, kw_only=True)
class HandwrittenResult:
    best: PricedPipeline | None  # None: no configuration of the method fits
    graph: OpGraph | None  # the best plan's graph at its microbatch size
    num_solves: int
    tables_s: float
    score_s: float
    price_s: float
    stages_built: int  # stage problems built for pricing (the others reused by shape)
    stages_reused: int
    least_memory_bytes: float | None = None  # no plan fits: the least a plan of the method needs per device
    least_memory_parts: MemoryParts | None = None  # and that plan's fullest device in parts (its does-not-fit advice)


def mesh_choices_of(method: str, setup: CostSetup, options: PlanOptions, num_layers: int) -> MeshChoices:
    """The submeshes and logical meshes ``method`` reads (see the module docstring)."""
    every = mesh_choices(setup)
    if method == Method.UNIFORM_PIPELINE:
        sizes = {setup.cluster.num_devices // p for p in range(1, num_layers + 1) if setup.cluster.num_devices % p == 0}
        return [(submesh, shapes) for submesh, shapes in every if submesh.size in sizes]
    degrees = (1, 1, setup.cluster.num_devices) if method == Method.DATA_PARALLEL else options.degrees
    wanted: dict[int, set[tuple[int, ...]]] = {}
    for (t, _, d), shape in grid_points(setup, num_layers=num_layers, degrees=degrees):
        wanted.setdefault(t * d, set()).add(shape)
    return [
        (submesh, [q for q in shapes if q in wanted[submesh.size]])
        for submesh, shapes in every
        if submesh.size in wanted
    ]


def handwritten_plan(method: str, inputs: PlanningInput) -> HandwrittenResult:
    """The best exactly priced plan of ``method`` (``data-parallel``, ``megatron`` or ``uniform-pipeline``) over the
    counts; a data-parallel plan's are those of the grid point ``(1, 1, D)``."""
    setup, options = inputs.setup, inputs.options
    assert method in HANDWRITTEN, method
    sources = {"megatron": ("megatron", "data-parallel"), "data-parallel": ("data-parallel",)}.get(method)
    tables, started = LayerTables(setup, options, sources=sources), time.perf_counter()
    depth = options.degrees[1] if options.degrees is not None else 0
    settings = _settings(method, inputs, tables, ungrouped=depth > MAX_LAYERS)
    tabled = time.perf_counter()
    found = _kept(method, settings, setup, options)
    result = _priced(found, inputs, tables, times=(started, tabled, time.perf_counter()), method=method)
    if result.best is None:
        smallest = least_memory(settings, setup, options=options, method=method)
        if smallest is not None:
            needed, parts = smallest_plan_memory(smallest, tables)
            result = replace(result, least_memory_bytes=needed, least_memory_parts=parts)
    return result


def smallest_plan_memory(candidate: GridCandidate, tables: LayerTables) -> tuple[float, MemoryParts | None]:
    """What the plan of least memory (:func:`planner.baselines.handwritten.least_memory`) needs per device by the
    span options, and its fullest device in parts (:func:`planner.baselines.handwritten.memory_parts`)."""
    return candidate.memory_bytes, memory_parts(candidate, tables.setup)


def pure_data_parallel(inputs: PlanningInput) -> PricedPipeline | None:
    """The one-microbatch data-parallel plan (:func:`planner.baselines.data_parallel.data_parallel`: each replica
    runs every operator on its rows) under DDP, or FSDP at ``--zero N``, and the fastest gradient sync the options
    offer; None when the options ask for recomputation, microbatches or a schedule, or when it does not fit."""
    plain, setup = _pure_data_parallel(inputs), inputs.setup
    if plain is None or plain.estimate.memory_per_device_bytes > setup.memory_budget_bytes:
        return None
    return reprice_data_parallel(
        plain,
        inputs.full_graph,
        setup,
        allow_lossy=inputs.options.allow_lossy,
        forced=inputs.options.grad_sync,
        zero=runs_as_fsdp(plain.stages),
    )


def _pure_data_parallel(inputs: PlanningInput) -> PricedPipeline | None:
    """:func:`pure_data_parallel` before the fit check and the gradient sync; None when the options rule it out."""
    full_graph, setup, options = inputs.full_graph, inputs.setup, inputs.options
    plain_options = options.remat in ("auto", "off", "off-or-full") and options.microbatches in (None, 1)
    if not plain_options or options.schedule != ScheduleChoice.AUTO or options.degrees is not None:
        return None
    level = 0 if str(options.zero) == "auto" else int(options.zero)
    try:  # a batch the devices cannot split, a layout the replicas cannot run
        stages, estimate = data_parallel(full_graph, setup, batch_size=inputs.graphs.batch_size, check=False)
    except AutoplanError:
        return None
    replicated = all(set(spec) == {"R"} for spec in stages[0].param_placements.values())
    if level and not replicated:  # FSDP shards whole replicated parameters (a MoE's experts are split already)
        return None
    stages, estimate = with_zero(stages, estimate, full_graph, setup, level=level, check=False)
    return PricedPipeline(stages=stages, estimate=estimate, num_microbatches=1, schedule=Schedule.NONE)


def data_parallel_plan(inputs: PlanningInput) -> HandwrittenResult:
    """``--method data-parallel``: the best plan of the grid point ``(1, 1, D)`` (microbatches, recomputation, ZeRO
    levels: :func:`handwritten_plan`) or the one-microbatch plan (:func:`pure_data_parallel`) when it is faster —
    the candidate ``auto`` holds for the method, by the same functions."""
    check_batch(inputs.graphs.batch_size, inputs.setup.cluster.num_devices)
    grid = handwritten_plan("data-parallel", inputs)
    pure = pure_data_parallel(inputs)
    faster = pure is not None and (grid.best is None or pure.estimate.step_time_s < grid.best.estimate.step_time_s)
    fitting = pure if faster else grid.best
    offloaded = with_offload(fitting, inputs)  # CPU offload: --offload on, or auto when nothing else fits
    if offloaded is not fitting:
        return replace(grid, best=offloaded, graph=inputs.full_graph if offloaded else grid.graph)
    if faster:
        return replace(grid, best=pure, graph=inputs.full_graph)
    if grid.best is None:  # the smaller of the grid's smallest plan and the one-microbatch plan as DDP or FSDP holds it
        unfit = _pure_data_parallel(inputs)
        pure_bytes = unfit and unfit.estimate.memory_per_device_bytes
        if pure_bytes and (grid.least_memory_bytes is None or pure_bytes < grid.least_memory_bytes):
            parts = pure_memory_parts(unfit, inputs)
            return replace(grid, least_memory_bytes=pure_bytes, least_memory_parts=parts)
    return grid


def pure_memory_parts(plan: PricedPipeline, inputs: PlanningInput) -> MemoryParts:
    """The one-microbatch data-parallel plan's memory in parts: every replica's state at its ZeRO level (with DDP's
    gradient buckets at level 0: they do not scale with the batch), the rest its activations; and the plan at each
    higher ZeRO level as FSDP holds it (:func:`planner.baselines.data_parallel.with_zero`)."""
    (stage,) = plan.stages
    replicas, setup = len(stage.devices), inputs.setup
    weights, grads, state = zero_shards(stage.zero, replicas)
    held = model_state_bytes(
        inputs.full_graph.num_params,
        optimizer=setup.optimizer,
        weight_shards=weights,
        grad_shards=grads,
        state_shards=state,
    )
    if stage.zero == 0:
        held += ddp_bucket_bytes(inputs.full_graph, setup, num_devices=replicas)
    total = plan.estimate.memory_per_device_bytes
    graph = inputs.full_graph
    at_zero = {
        level: with_zero(plan.stages, plan.estimate, graph, setup, level=level, check=False)[1].memory_per_device_bytes
        for level in range(stage.zero + 1, 4)
    }
    return MemoryParts(
        state_bytes=min(held, total),
        activation_bytes=max(0.0, total - held),
        zero=stage.zero,
        data_degree=replicas,
        num_microbatches=1,
        at_zero=at_zero,
    )


def megatron_at_scale(inputs: PlanningInput) -> HandwrittenResult:
    """The Megatron grid as an expert would try it on a large cluster: every ``(t, p, d)`` whose model state
    can fit (:func:`state_can_fit`, a lower bound: pruning is exact), each with its own microbatch counts
    down to one row per replica (as ``--degrees`` has), on whole model layers (no grouping, so up to one
    layer per stage)."""
    graphs, setup, options = inputs.graphs, inputs.setup, inputs.options
    tables, started = LayerTables(setup, options, sources=("megatron", "data-parallel")), time.perf_counter()
    num_layers = len(layering(graphs.full, max_layers=len(graphs.full.nodes)).layers)
    points = [
        point
        for point, _ in grid_points(setup, num_layers=num_layers)
        if state_can_fit(setup, inputs.full_graph.num_params, point, zero=0 if options.zero in ("0", 0) else 1)
    ]
    found, leaders, scoring_s, counts = [], [], 0.0, {}
    for point in points:
        single = replace(options, degrees=point)
        settings = _settings("megatron", replace(inputs, options=single), tables, ungrouped=True, counts=counts)
        scored = time.perf_counter()
        mine = _kept("megatron", settings, setup, single)
        found = sorted(found + mine, key=lambda candidate: candidate.step_time_s)[:KEEP]
        leaders += mine  # each point's kept candidates are priced too, as run alone: the scores only approximate
        scoring_s += time.perf_counter() - scored
    tabled = time.perf_counter() - scoring_s
    found += [candidate for candidate in leaders if not any(candidate is kept for kept in found)]
    return _priced(found, inputs, tables, times=(started, tabled, time.perf_counter()), method="megatron")


def _kept(method: str, settings: list[PipelineChoice], setup: CostSetup, options: PlanOptions) -> list:
    """The :data:`KEEP` best-scored candidates of ``method`` over ``settings``, to be priced exactly."""
    return best_handwritten(settings, setup, options=options, keep=KEEP, methods=(method,)).get(method, [])


def state_can_fit(setup: CostSetup, num_params: int, point: tuple[int, int, int], *, zero: int) -> bool:
    """Whether ``(t, p, d)``'s model state could fit: every parameter split over all ``t·p`` devices of a
    replica (and what ZeRO level ``zero`` shards over ``d`` too) is the least any layout holds."""
    t, p, d = point
    weights, grads, state_shards = zero_shards(int(zero), d)
    state = model_state_bytes(
        num_params / (t * p),
        optimizer=setup.optimizer,
        weight_shards=weights,
        grad_shards=grads,
        state_shards=state_shards,
    )
    return state <= setup.memory_budget_bytes


def _settings(
    method: str,
    inputs: PlanningInput,
    tables: LayerTables,
    *,
    ungrouped: bool,
    counts: dict[int, CountLayout] | None = None,
) -> list[PipelineChoice]:
    """Per microbatch count, the span options of the method's own submeshes and meshes; ``counts`` keeps each
    count's graph, layers and boundary table for the next call (one layering for every grid point)."""
    graphs, setup, options = inputs.graphs, inputs.setup, inputs.options
    counts = {} if counts is None else counts
    schedule = pipeline_schedule(options)
    data_degree = None if options.degrees is None else options.degrees[2]
    settings = []
    for m in microbatch_counts(graphs.batch_size, options.microbatches, data_degree=data_degree):
        if m not in counts:
            counts[m] = count_layout(graphs, m, setup, max_layers=None if ungrouped else MAX_LAYERS)
        layout = counts[m]
        choices = mesh_choices_of(method, setup, options, len(layout.layers.layers))
        if not any(shapes for _, shapes in choices):
            continue
        spans = option_arrays(layout.graph, layout.layers, tables, m, choices=choices, progress=inputs.progress)
        settings.append(layout.choice(schedule=schedule, spans=spans))
    return settings


def _priced(
    found: list, inputs: PlanningInput, tables: LayerTables, *, times: tuple[float, float, float], method: str
) -> HandwrittenResult:
    """The candidates priced exactly (no refinement, stage problems shared by shape); the fastest that fits.
    Megatron's pipelines are also tried under its interleaved schedule (Narayanan et al. 2021 §2.2), as an
    expert running Megatron-LM would (:func:`planner.inter.schedule_variants.best_rescheduled`)."""
    started, tabled, scored = times
    full_graph, schedule, shapes = inputs.full_graph, inputs.options.schedule, StageShapes()
    candidates = [(method, Candidate(setting=c.setting, specs=c.specs, refine=False)) for c in found]
    priced, graph_of, pipelines = price_candidates(
        candidates, full_graph=full_graph, tables=tables, progress=inputs.progress, shapes=shapes
    )
    best, graph, pipelines = priced.get(method), graph_of.get(method), pipelines.get(method, [])
    found_variant = best_rescheduled(
        pipelines, full_graph=full_graph, tables=tables, schedules=method_schedules(method, schedule)
    )
    best = with_variant(best, found_variant, mode=schedule)
    graph = found_variant[1].setting.graph if found_variant is not None and best is found_variant[0] else graph
    return HandwrittenResult(
        best=best,
        graph=graph,
        num_solves=tables.num_solves,
        tables_s=tabled - started,
        score_s=scored - tabled,
        price_s=time.perf_counter() - scored,
        stages_built=shapes.num_built,
        stages_reused=shapes.num_reused,
    )
