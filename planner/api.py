"""The library entry point: ``plan(model, example_inputs, cluster, *, batch_size) -> Plan``.

:func:`plan` captures the model (:mod:`planner.ir.capture`), builds the cost setup (cluster,
compute model, optimizer), runs the chosen method and returns a validated :class:`Plan`.
:func:`plan_model_file` does the same from a model file, building the model on the meta
device so that nothing is allocated. Methods are looked up in :data:`METHODS`; ``auto`` is the
two-level search (:mod:`planner.auto`): pipeline stages on submeshes by DP, each operator's
sharding by the intra-op problem, microbatches, schedule and recomputation; ``megatron`` and
``uniform-pipeline`` are the best hand-written plans of those kinds under the same cost model;
the placement baselines (:mod:`planner.baselines.placement.methods`) put every operator on one device.
:func:`prepare` captures once and :func:`plan_prepared` runs a method on it (``plan compare``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from cost_models.cluster import Cluster, load_cluster
from cost_models.mfu_bounds import mfu_bound_note
from planner.auto import AutoResult, auto_plan
from planner.baselines.handwritten import check_degrees
from planner.baselines.handwritten_plan import data_parallel_plan, handwritten_plan, megatron_at_scale
from planner.baselines.method_options import check_method_options, does_not_fit_message
from planner.baselines.placement.methods import PLACEMENT_METHODS, run_placement
from planner.costing.runtime_profiles import OUR_RUNTIME, RuntimeProfile, runtime_profile
from planner.costing.setup import CostSetup, default_optimizer, loss_bytes_per_output_element, make_compute_model
from planner.costing.stage_work import runs_as_ddp
from planner.costing.zero import runs_as_fsdp
from planner.errors import AutoplanError, InternalError
from planner.inter.search import SEARCH_SPACES, PipelineOptions, Progress, allowed_slots, microbatch_counts
from planner.inter.sp_saving import with_sequence_parallel_savings
from planner.inter.stage_dp.solver import is_large
from planner.inter.stage_pricing import PricedPipeline
from planner.ir.graph import OpGraph
from planner.ir.model_file import instantiate, load_model_file
from planner.ir.op_kinds import BATCH_STATISTICS
from planner.ir.rebatch import MicrobatchGraphs, capture_graphs
from planner.plan import GradSync, ModelRef, Plan, PlanError, SearchStats, validate_plan
from planner.tuning import (
    DEFAULT_CANDIDATES,
    Measurement,
    TuneResult,
    TuneRow,
    candidate_names,
    choose,
    fits,
    learn,
    tuned_plan,
)

METHODS: dict[str, str] = {
    "auto": "the best plan autoplan can search: pipeline stages by DP, per-operator sharding by ILP, "
    "microbatches, schedule and recomputation",
    "data-parallel": "every device holds the model and a 1/d slice of the batch",
    "megatron": "the best Megatron (tensor, pipeline, data) grid point, priced like auto (--degrees: one point)",
    "uniform-pipeline": "equal layers per stage on equal submeshes, each stage sharded by ILP",
    **PLACEMENT_METHODS,
}
AUTO_FAMILY = ("auto", "megatron", "uniform-pipeline")
HANDWRITTEN_ALONE = ("data-parallel", "megatron", "uniform-pipeline")  # without the auto search: handwritten_plan


@dataclass(kw_only=True)
class Prepared:
    """A captured model with its cost setup, shared by every method run on it (``plan compare``)."""

    graph: OpGraph
    graphs: MicrobatchGraphs
    setup: CostSetup
    model: ModelRef
    batch_size: int
    options: PipelineOptions
    microbatches: int | None
    rl_budget_s: float
    rl_iterations: int | None
    seed: int
    capture_s: float
    captured_before_s: float  # graphs.capture_s when prepared (already in capture_s)
    cost_s: float
    notes: tuple[str, ...]
    progress: Progress | None = None
    auto: tuple[AutoResult, float] | None = None  # the auto search and its seconds, run once


def _auto(prepared: Prepared) -> tuple[AutoResult, float]:
    if prepared.auto is None:
        started = time.perf_counter()
        result = auto_plan(
            prepared.graphs, prepared.graph, prepared.setup, options=prepared.options, progress=prepared.progress
        )
        prepared.auto = (result, time.perf_counter() - started)
    return prepared.auto


def _run_method(name: str, prepared: Prepared) -> tuple[PricedPipeline, SearchStats, tuple[str, ...]]:
    """The plan of method ``name``, its search statistics (``time_s``: this method's search) and notes."""
    setup, options = prepared.setup, prepared.options
    if name in PLACEMENT_METHODS and options.grad_sync is not None and options.grad_sync.lossy:
        raise AutoplanError(f"--grad-sync {options.grad_sync.label}: op placements ({name}) sync no gradients")
    if name in PLACEMENT_METHODS:
        started = time.perf_counter()
        chosen, notes = run_placement(
            name,
            prepared.graphs,
            setup,
            batch_size=prepared.batch_size,
            microbatches=prepared.microbatches,
            rl_budget_s=prepared.rl_budget_s,
            rl_iterations=prepared.rl_iterations,
            seed=prepared.seed,
            progress=prepared.progress,
        )
        return chosen, SearchStats(time_s=time.perf_counter() - started), notes
    if name in HANDWRITTEN_ALONE:
        return _run_handwritten(name, prepared)
    result, search_s = _auto(prepared)
    stats = SearchStats(
        time_s=search_s, ilp_solves=result.num_solves, ilp_s=result.ilp_s, dp_s=result.dp_s, price_s=result.price_s
    )
    compared = ", ".join(f"{method} {p.estimate.step_time_s:.4g} s" for method, p in sorted(result.priced.items()))
    notes = (f"compared under the same cost model: {compared}; chosen: {result.chosen_by}",)
    return result.best, stats, notes


def _run_handwritten(name: str, prepared: Prepared) -> tuple[PricedPipeline, SearchStats, tuple[str, ...]]:
    """``data-parallel``, ``megatron`` or ``uniform-pipeline`` alone: only the tables its configurations read; the
    plan ``auto`` holds as that method's candidate."""
    started = time.perf_counter()
    options = prepared.options
    at_scale = name == "megatron" and options.degrees is None and is_large(prepared.setup.cluster)
    run = {"data-parallel": data_parallel_plan, "megatron": megatron_at_scale if at_scale else None}.get(name)
    run = run or partial(handwritten_plan, name)
    found = run(prepared.graphs, prepared.graph, prepared.setup, options=options, progress=prepared.progress)
    if found.best is None:
        raise AutoplanError(does_not_fit_message(name, options, prepared.setup, found.least_memory_bytes))
    stats = SearchStats(
        time_s=time.perf_counter() - started,
        ilp_solves=found.num_solves,
        ilp_s=found.tables_s,
        dp_s=found.score_s,
        price_s=found.price_s,
    )
    note = f"stage problems priced: {found.stages_built} built, {found.stages_reused} reused by shape"
    return found.best, stats, (note,)


def search_space(space: str, *, remat: str, zero: str | int, schedule: str, allow_lossy: bool) -> tuple[str, str | int]:
    """``--remat`` and ``--zero`` within ``--space``; AutoplanError for an option outside it. ``alpa``: Alpa's
    space (Zheng et al. 2022): GPipe or 1F1B, each stage recomputing all its layers or none, no ZeRO; sequence
    parallelism (planner.intra.stage_problem) and schedule variants (planner.inter.schedule_variants) are off."""
    if space not in SEARCH_SPACES:
        raise AutoplanError(f"--space must be one of {', '.join(SEARCH_SPACES)}, got {space!r}")
    if space == "full":
        return remat, zero
    outside = [
        *([f"--schedule {schedule}"] if schedule not in ("auto", "1f1b", "gpipe") else []),
        *([f"--remat {remat}"] if remat == "attention" else []),
        *([f"--zero {zero}"] if str(zero) not in ("auto", "0") else []),
        *(["--allow-lossy"] if allow_lossy else []),
    ]
    if outside:
        raise AutoplanError(f"{', '.join(outside)} is outside --space alpa: drop it or use --space full")
    return ("off-or-full" if remat == "auto" else remat), "0"


def _forced_grad_sync(grad_sync: GradSync | str | None, *, allow_lossy: bool) -> GradSync | None:
    """``--grad-sync`` read and checked: a lossy one only with ``--allow-lossy``."""
    forced = GradSync.parse(grad_sync) if isinstance(grad_sync, str) else grad_sync
    if forced is not None and forced.lossy and not allow_lossy:
        raise AutoplanError(f"--grad-sync {forced.label} changes the gradients the optimizer sees: add --allow-lossy")
    return forced


def _resolve_cluster(cluster: Cluster | str) -> Cluster:
    return cluster if isinstance(cluster, Cluster) else load_cluster(cluster)


def prepare(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    cluster: Cluster | str,
    *,
    batch_size: int,
    tracer: str = "export",
    optimizer: str | None = None,
    cost_model: str = "roofline",
    memory_fraction: float = 1.0,
    max_stages: int | None = None,
    microbatches: int | None = None,
    schedule: str = "auto",
    remat: str = "auto",
    zero: str | int = "auto",
    allow_lossy: bool = False,
    grad_sync: GradSync | str | None = None,
    space: str = "full",
    ilp_time_limit_s: float = 30.0,
    degrees: tuple[int, int, int] | None = None,
    rl_budget_s: float = 30.0,
    rl_iterations: int | None = None,
    seed: int = 0,
    model_ref: dict[str, Any] | None = None,
    progress: Progress | None = None,
    jobs: int = 1,
    runtime: str = OUR_RUNTIME,
) -> Prepared:
    """Check the options, capture the model and build its cost setup (see :func:`plan`)."""
    if batch_size <= 0:
        raise AutoplanError(f"--batch-size must be a positive integer, got {batch_size}")
    if max_stages is not None and max_stages < 1:
        raise AutoplanError(f"--max-stages must be at least 1, got {max_stages}")
    if jobs < 1:
        raise AutoplanError(f"--jobs must be at least 1, got {jobs}")
    if rl_budget_s <= 0:
        raise AutoplanError(f"--rl-budget-s must be positive, got {rl_budget_s:g}")
    if rl_iterations is not None and rl_iterations < 1:
        raise AutoplanError(f"--rl-iterations must be at least 1, got {rl_iterations}")
    forced = _forced_grad_sync(grad_sync, allow_lossy=allow_lossy)
    profile = runtime_profile(runtime)
    remat, zero = search_space(space, remat=remat, zero=zero, schedule=schedule, allow_lossy=allow_lossy)
    pipeline = PipelineOptions(
        max_stages=max_stages,
        microbatches=microbatches,
        schedule=schedule,
        remat=remat,
        zero=zero,
        ilp_time_limit_s=ilp_time_limit_s,
        degrees=degrees,
        jobs=jobs,
        allow_lossy=allow_lossy,
        grad_sync=forced,
        space=space,
    )
    counts = microbatch_counts(batch_size, microbatches, data_degree=None if degrees is None else degrees[2])
    allowed_slots(remat, zero)
    if not 0 < memory_fraction <= 1:
        raise AutoplanError(
            f"--memory-fraction must be in (0, 1] (a share of the usable memory), got {memory_fraction}"
        )
    cluster = _resolve_cluster(cluster)
    check_degrees(degrees, cluster)
    started = time.perf_counter()
    # at scale the Megatron grid reaches one row per replica (megatron_at_scale): capture down to one row
    one_row = is_large(cluster) and degrees is None and microbatches is None
    graphs = capture_graphs(
        model,
        example_inputs,
        batch_size=batch_size,
        smallest=1 if one_row else batch_size // counts[-1],
        tracer=tracer,
        jobs=jobs,
    )
    graph = graphs.full
    captured = time.perf_counter()
    ref = dict(model_ref or {})
    setup = CostSetup(
        cluster=cluster,
        compute=make_compute_model(graph, cluster, cost_model=cost_model),
        optimizer=optimizer or default_optimizer(cluster),
        memory_fraction=memory_fraction,
        runtime=profile,
        loss_bytes_per_output_element=loss_bytes_per_output_element(
            ref.get("file"), ref.get("args", {}), graph, batch_size=batch_size
        ),
    )
    model_json = ModelRef(
        fingerprint=graph.fingerprint(),
        num_params=graph.num_params,
        file=ref.get("file"),
        args=ref.get("args", {}),
        tracer=tracer,
    )
    return Prepared(
        graph=graph,
        graphs=graphs,
        setup=setup,
        model=model_json,
        batch_size=batch_size,
        options=pipeline,
        microbatches=microbatches,
        rl_budget_s=rl_budget_s,
        rl_iterations=rl_iterations,
        seed=seed,
        capture_s=captured - started,
        captured_before_s=graphs.capture_s,
        cost_s=time.perf_counter() - captured,
        notes=(f"compute times: {cost_model}",),
        progress=progress,
    )


def plan_prepared(prepared: Prepared, method: str = "auto") -> Plan:
    """The validated plan of ``method`` on a prepared model; ``search.time_s`` is that method's search
    (the auto-family methods share one search: each reports its seconds)."""
    if method not in METHODS:
        raise AutoplanError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")
    check_method_options(method, prepared.options)
    chosen, stats, method_notes = _run_method(method, prepared)
    return _finish_plan(prepared, method, chosen, stats, method_notes)


def _finish_plan(
    prepared: Prepared, method: str, chosen: PricedPipeline, stats: SearchStats, method_notes: tuple[str, ...]
) -> Plan:
    """The validated plan of a priced candidate: notes, batch statistics and what sequence parallelism saved."""
    graphs = prepared.graphs
    result = Plan(
        method=method,
        model=prepared.model,
        cluster=prepared.setup.cluster,
        batch_size=prepared.batch_size,
        num_microbatches=chosen.num_microbatches,
        schedule=chosen.schedule,
        optimizer=prepared.setup.optimizer,
        memory_fraction=prepared.setup.memory_fraction,
        grad_sync=chosen.grad_sync,
        runtime=prepared.setup.runtime.name,
        stages=chosen.stages,
        estimate=chosen.estimate,
        search=replace(
            stats,
            time_s=stats.time_s + prepared.capture_s + prepared.cost_s,
            capture_s=prepared.capture_s + graphs.capture_s - prepared.captured_before_s,
            cost_s=prepared.cost_s,
        ),
        notes=(
            *method_notes,
            *chosen.notes,
            *prepared.notes,
            *_notes(graphs, ddp=runs_as_ddp(chosen.stages), runtime=prepared.setup.runtime),
            *_estimate_notes(prepared.setup, mfu=chosen.estimate.mfu, num_params=prepared.model.num_params),
        ),
    )
    result = with_batch_statistics(result, prepared.graph)
    result = with_sequence_parallel_savings(result, chosen.stage_choices, prepared.setup)  # what it saved, per stage
    try:
        validate_plan(result, prepared.graph)
    except PlanError as error:  # a plan we just made that breaks our own rules: our bug
        raise InternalError(f"the {method} plan fails its own check: {error}") from error
    problem = result.estimate.breakdown_error()
    if problem is not None:  # the parts of a step we print must add up to it
        raise InternalError(f"the {method} plan's estimate breakdown is wrong: {problem}")
    return result


def candidate_plan(prepared: Prepared, name: str) -> Plan:
    """Auto's candidate ``name`` (a key of its priced candidates) as a validated plan: a family's is that method's
    own plan, auto's pick is ``plan_prepared(prepared, "auto")``, any other is an auto plan of that candidate."""
    if name in HANDWRITTEN_ALONE:
        return plan_prepared(prepared, name)
    result, search_s = _auto(prepared)
    if name == result.chosen_by:
        return plan_prepared(prepared, "auto")
    stats = SearchStats(
        time_s=search_s, ilp_solves=result.num_solves, ilp_s=result.ilp_s, dp_s=result.dp_s, price_s=result.price_s
    )
    return _finish_plan(prepared, "auto", result.priced[name], stats, (f"auto's {name} candidate (not its pick)",))


def tune_prepared(
    prepared: Prepared, *, measure: Callable[[str, Plan], Measurement], candidates: int = DEFAULT_CANDIDATES
) -> TuneResult:
    """Plan, run up to ``candidates`` distinct candidates with ``measure(name, plan)`` (the caller runs them: the
    planner starts no process; ``planner.cli.tune.measure_locally`` runs them on this machine) and keep the measured
    fastest that fits, with the corrections the measurements support (:mod:`planner.tuning`). AutoplanError when
    no candidate ran."""
    result, _ = _auto(prepared)
    rows = []
    for name in candidate_names(result, count=candidates):
        plan = candidate_plan(prepared, name)
        measured = measure(name, plan)
        rows.append(TuneRow(name=name, plan=plan, measurement=measured, fits=fits(plan, measured)))
    chosen = choose(rows)
    if chosen is None:
        reasons = "; ".join(f"{row.name}: {row.measurement.error or 'over the memory budget'}" for row in rows)
        raise AutoplanError(f"no candidate ran within its memory budget ({reasons})")
    corrections = learn(rows, prepared.graphs.at, prepared.setup)
    return TuneResult(
        rows=tuple(rows), chosen=chosen, plan=tuned_plan(rows, chosen), corrections=corrections, auto_name=rows[0].name
    )


def tune(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    cluster: Cluster | str,
    *,
    batch_size: int,
    measure: Callable[[str, Plan], Measurement],
    candidates: int = DEFAULT_CANDIDATES,
    **options: Any,
) -> TuneResult:
    """:func:`plan`, then the measured loop of :func:`tune_prepared`: e.g. ``tune(model, inputs, "local-cpu",
    batch_size=8, measure=planner.cli.tune.measure_locally)``."""
    return tune_prepared(
        prepare(model, example_inputs, cluster, batch_size=batch_size, **options),
        measure=measure,
        candidates=candidates,
    )


def with_batch_statistics(plan: Plan, graph: OpGraph) -> Plan:
    """State how many rows each batch-normalization call sees under ``plan``: a data-parallel run
    (DDP or FSDP) normalizes each replica's share of a microbatch, every other executor the whole
    microbatch (tensor-parallel stages gather a batch-split input first)."""
    if not any(node.op_name in BATCH_STATISTICS for node in graph.nodes):
        return plan
    rows = plan.batch_size // plan.num_microbatches
    if plan.schedule != "dataflow" and (runs_as_ddp(plan.stages) or runs_as_fsdp(plan.stages)):  # DDP, or FSDP
        rows //= len(plan.stages[0].devices)
    share = "one replica's share of a microbatch" if rows * plan.num_microbatches < plan.batch_size else "a microbatch"
    note = (
        f"batch normalization computes its statistics over {rows} of the batch's {plan.batch_size} rows per call "
        f"({share}); plan run --check-parity compares with one device normalizing the same chunks"
    )
    return replace(plan, batch_stat_rows=rows, notes=(*plan.notes, note) if rows < plan.batch_size else plan.notes)


def plan(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    cluster: Cluster | str,
    *,
    batch_size: int,
    method: str = "auto",
    **options: Any,
) -> Plan:
    """Find a parallel plan for training ``model`` on ``cluster`` with global ``batch_size``.

    ``example_inputs`` are one step's inputs at ``batch_size``. The model may live on the
    meta device. Options (keyword only): ``tracer``, ``optimizer``, ``cost_model``,
    ``memory_fraction`` (share of the usable memory: capacity less the device's reserve,
    :func:`cost_models.cluster.memory_budget_bytes`), ``max_stages`` (None: any), ``microbatches``
    (None: searched), ``schedule``, ``remat``, ``zero``, ``allow_lossy``, ``grad_sync``, ``space`` (``"alpa"``:
    Alpa's search space only, :func:`search_space`), ``ilp_time_limit_s``, ``degrees`` (``(t, p, d)`` for
    ``megatron``), ``rl_budget_s``, ``rl_iterations`` (None: until the budget is spent) and ``seed`` (``rl``), ``model_ref``,
    ``runtime`` (the system the estimate describes, :mod:`planner.costing.runtime_profiles`; default ours), ``jobs`` (processes for the
    search's independent work: with 2 or more, the second export runs beside the first; default 1),
    and ``progress(what, done, total)``, called during the search. Raises :class:`AutoplanError`
    for bad input or a model that does not fit.
    """
    if method not in METHODS:
        raise AutoplanError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")
    return plan_prepared(prepare(model, example_inputs, cluster, batch_size=batch_size, **options), method)


def _notes(graphs: MicrobatchGraphs, *, ddp: bool, runtime: RuntimeProfile) -> tuple[str, ...]:
    sync = (
        "gradient all-reduce: DDP's buckets, overlapped with the last backward as DDP runs them"
        if ddp
        else "gradient sync: each sharded stage's partial sums all-reduced in buckets, overlapped with its last "
        "backward (executors.parallel.grad_sync)"
    )
    if runtime.grad_sync_after_backward:
        sync = f"gradient sync: one buffer per stage, all-reduced after its last backward ({runtime.name})"
    return (f"model captured {graphs.num_captures} time(s), other microbatch sizes interpolated", sync)


def _estimate_notes(setup: CostSetup, *, mfu: float, num_params: float) -> tuple[str, ...]:
    """What the estimate describes when not our executors, and an MFU above the best published one."""
    device = setup.cluster.device
    gemm = device.kernels.gemm_efficiency if device.kernels is not None else None
    above = mfu_bound_note(device_name=device.name, num_params=num_params, mfu=mfu, gemm_efficiency=gemm)
    return tuple(note for note in (setup.runtime.note(), above) if note)


def prepare_model_file(
    path: str | Path,
    cluster: Cluster | str,
    *,
    batch_size: int,
    model_args: dict[str, Any] | None = None,
    **options: Any,
) -> Prepared:
    """:func:`prepare` for a model file, built on the meta device."""
    model_file = load_model_file(path)
    args = dict(model_args or {})
    model, inputs = instantiate(model_file, batch_size=batch_size, model_args=args)
    ref = {"file": str(Path(path).resolve()), "args": args}  # absolute: the plan runs from any directory
    return prepare(model, inputs, cluster, batch_size=batch_size, model_ref=ref, **options)


def plan_model_file(
    path: str | Path,
    cluster: Cluster | str,
    *,
    batch_size: int,
    model_args: dict[str, Any] | None = None,
    method: str = "auto",
    **options: Any,
) -> Plan:
    """:func:`plan` for a model file, built on the meta device."""
    if method not in METHODS:
        raise AutoplanError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")
    prepared = prepare_model_file(path, cluster, batch_size=batch_size, model_args=model_args, **options)
    return plan_prepared(prepared, method)
