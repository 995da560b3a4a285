"""The library entry point: ``plan(model, example_inputs, cluster, *, batch_size) -> Plan``.

:func:`plan` builds the options once (:class:`planner.options.PlanOptions`, from its keyword arguments), captures
the model and builds the cost setup (:func:`prepare`, :mod:`planner.preparation`), runs the chosen method (the
registry :data:`planner.methods.METHODS`) and returns a validated :class:`Plan`. :func:`plan_model_file` does the
same from a model file, building the model on the meta device so that nothing is allocated. :func:`prepare`
captures once and :func:`plan_prepared` runs a method on it (``plan compare``); :func:`tune` and
:func:`tune_prepared` run the best candidates and keep the measured fastest (``plan tune``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from cost_models.cluster import Cluster, load_cluster
from cost_models.mfu_bounds import mfu_bound_note
from planner.baselines.method_options import check_method_options
from planner.costing.runtime_profiles import RuntimeProfile
from planner.costing.setup import CostSetup
from planner.costing.stage_work import runs_as_ddp
from planner.costing.zero import runs_as_fsdp
from planner.errors import AutoplanError, InternalError
from planner.inter.runnable_rows import rows_refusal
from planner.inter.search import Progress
from planner.inter.sp_saving import with_sequence_parallel_savings
from planner.ir.graph import OpGraph
from planner.ir.op_kinds import BATCH_STATISTICS
from planner.ir.rebatch import MicrobatchGraphs
from planner.methods import METHODS, AutoSearch, MethodRun, auto_run, search_auto
from planner.options import HANDWRITTEN_METHODS, Method, PlanOptions, parse_method
from planner.plan import Plan, PlanError, validate_plan
from planner.plan.report import plan_summary
from planner.plan.schedules import Schedule
from planner.preparation import Prepared, model_from_file, prepare_model
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

__all__ = [
    "METHODS",
    "PlanOptions",
    "Prepared",
    "candidate_plan",
    "plan",
    "plan_model_file",
    "plan_prepared",
    "prepare",
    "prepare_model_file",
    "summary",
    "tune",
    "tune_prepared",
    "with_batch_statistics",
]


def plan_options(options: PlanOptions | None = None, **keywords: Any) -> PlanOptions:
    """The options of a call: ``options`` with the ``keywords`` given beside it, or the keywords alone."""
    if options is None:
        return PlanOptions(**keywords)
    return replace(options, **keywords) if keywords else options


def _cluster(cluster: Cluster | str) -> Cluster:
    """The one place a cluster named by the API's caller is loaded (the command line loads its own)."""
    return cluster if isinstance(cluster, Cluster) else load_cluster(cluster)


def prepare(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    cluster: Cluster | str,
    *,
    batch_size: int,
    options: PlanOptions | None = None,
    model_ref: dict[str, Any] | None = None,
    progress: Progress | None = None,
    **keywords: Any,
) -> Prepared:
    """Check the options, capture the model and build its cost setup (see :func:`plan`)."""
    return prepare_model(
        model,
        example_inputs,
        _cluster(cluster),
        batch_size=batch_size,
        options=plan_options(options, **keywords),
        model_ref=model_ref,
        progress=progress,
    )


def prepare_model_file(
    path: str | Path,
    cluster: Cluster | str,
    *,
    batch_size: int,
    model_args: dict[str, Any] | None = None,
    **keywords: Any,
) -> Prepared:
    """:func:`prepare` for a model file, built on the meta device; ``keywords`` as :func:`prepare`'s."""
    model, example_inputs, model_ref = model_from_file(path, batch_size=batch_size, model_args=model_args)
    return prepare(model, example_inputs, cluster, batch_size=batch_size, model_ref=model_ref, **keywords)


def plan_prepared(prepared: Prepared, method: Method | str | None = None, *, search: AutoSearch | None = None) -> Plan:
    """The validated plan of ``method`` (default: the options' ``method``) on a prepared model; ``search.time_s``
    is that method's search. ``search``: auto's search when the caller already ran it (:func:`search_auto`)."""
    chosen = prepared.options.method if method is None else parse_method(method)
    check_method_options(chosen, prepared.options)
    if chosen == Method.AUTO and search is not None:
        return _finish_plan(prepared, chosen, auto_run(search))
    return _finish_plan(prepared, chosen, METHODS[chosen].run(prepared))


def _finish_plan(prepared: Prepared, method: Method, run: MethodRun) -> Plan:
    """The validated plan of a priced candidate: notes, batch statistics and what sequence parallelism saved."""
    graphs, chosen, stats = prepared.graphs, run.chosen, run.stats
    refusal = rows_refusal(
        stages=chosen.stages, num_microbatches=chosen.num_microbatches, graphs=graphs, what=f"the {method} plan"
    )
    if refusal is not None:  # its ranks could not run its operators: refused here, not at run time
        raise AutoplanError(refusal)
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
        loss_bytes_per_output_element=prepared.setup.loss_bytes_per_output_element,
        outputs_batch_major=prepared.setup.loss_rows_batch_size > 0,
        stages=chosen.stages,
        estimate=chosen.estimate,
        search=replace(
            stats,
            time_s=stats.time_s + prepared.capture_s + prepared.cost_s,
            capture_s=prepared.capture_s + graphs.capture_s - prepared.captured_before_s,
            cost_s=prepared.cost_s,
        ),
        notes=(
            *run.notes,
            *chosen.notes,
            *prepared.notes,
            *_notes(
                graphs,
                ddp=runs_as_ddp(chosen.stages),
                runtime=prepared.setup.runtime,
                parameter_server=chosen.grad_sync.kind == "ps",
            ),
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


def candidate_plan(prepared: Prepared, name: str, *, search: AutoSearch | None = None) -> Plan:
    """Auto's candidate ``name`` (a key of ``search``'s priced candidates; None: search now) as a validated plan: a
    family's is that method's own plan, auto's pick is auto's plan, any other is an auto plan of that candidate."""
    if name in HANDWRITTEN_METHODS:
        return plan_prepared(prepared, name)
    search = search or search_auto(prepared)
    if name == search.result.chosen_by:
        return plan_prepared(prepared, Method.AUTO, search=search)
    notes = (f"auto's {name} candidate (not its pick)",)
    run = MethodRun(chosen=search.result.priced[name], stats=search.stats, notes=notes)
    return _finish_plan(prepared, Method.AUTO, run)


def tune_prepared(
    prepared: Prepared, *, measure: Callable[[str, Plan], Measurement], candidates: int = DEFAULT_CANDIDATES
) -> TuneResult:
    """Plan, run up to ``candidates`` distinct candidates with ``measure(name, plan)`` (the caller runs them: the
    planner starts no process; ``planner.cli.tune.measure_locally`` runs them on this machine) and keep the measured
    fastest that fits, with the corrections the measurements support (:mod:`planner.tuning`). AutoplanError when
    no candidate ran."""
    search = search_auto(prepared)
    rows = []
    for name in candidate_names(search.result, count=candidates):
        plan = candidate_plan(prepared, name, search=search)
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


def plan(
    model: torch.nn.Module, example_inputs: Sequence[Any], cluster: Cluster | str, *, batch_size: int, **keywords: Any
) -> Plan:
    """Find a parallel plan for training ``model`` on ``cluster`` with global ``batch_size``.

    ``example_inputs`` are one step's inputs at ``batch_size``. The model may live on the meta device. The
    options are a :class:`~planner.options.PlanOptions` or its fields as keywords (both: the keywords override):
    ``method`` (default ``auto``, :data:`planner.methods.METHODS`), ``tracer``, ``optimizer``, ``cost_model``,
    ``memory_fraction`` (share of the usable memory: capacity less the device's reserve,
    :func:`cost_models.cluster.memory_budget_bytes`), ``max_stages`` (None: any), ``microbatches`` (None:
    searched), ``schedule``, ``remat``, ``zero``, ``allow_lossy``, ``grad_sync``, ``space`` (``"alpa"``: Alpa's
    search space only), ``ilp_time_limit_s``, ``degrees`` (``(t, p, d)`` for ``megatron``), ``rl_budget_s``,
    ``rl_iterations`` (None: until the budget is spent) and ``seed`` (``rl``), ``runtime`` (the system the
    estimate describes, :mod:`planner.costing.runtime_profiles`; default ours), ``jobs`` (processes for the
    search's independent work: with 2 or more, the second export runs beside the first; default 1, where the
    ``plan`` command uses the machine's cores: a library call forks only when asked). Beside them:
    ``model_ref`` (the model file and arguments the plan names) and ``progress(what, done, total)``, called
    during the search (the keywords of :func:`prepare`). Raises :class:`AutoplanError` for bad input or a model
    that does not fit.
    """
    return plan_prepared(prepare(model, example_inputs, cluster, batch_size=batch_size, **keywords))


def plan_model_file(path: str | Path, cluster: Cluster | str, *, batch_size: int, **keywords: Any) -> Plan:
    """:func:`plan` for a model file, built on the meta device; ``keywords`` as :func:`prepare_model_file`'s
    (``model_args``, the model's keyword arguments, and those of :func:`prepare`)."""
    return plan_prepared(prepare_model_file(path, cluster, batch_size=batch_size, **keywords))


def with_batch_statistics(plan: Plan, graph: OpGraph) -> Plan:
    """State how many rows each batch-normalization call sees under ``plan``: a data-parallel run
    (DDP or FSDP) normalizes each replica's share of a microbatch, every other executor the whole
    microbatch (tensor-parallel stages gather a batch-split input first)."""
    if not any(node.op_name in BATCH_STATISTICS for node in graph.nodes):
        return plan
    rows = plan.batch_size // plan.num_microbatches
    if plan.schedule != Schedule.DATAFLOW and (runs_as_ddp(plan.stages) or runs_as_fsdp(plan.stages)):  # DDP, or FSDP
        rows //= len(plan.stages[0].devices)
    share = "one replica's share of a microbatch" if rows * plan.num_microbatches < plan.batch_size else "a microbatch"
    note = (
        f"batch normalization computes its statistics over {rows} of the batch's {plan.batch_size} rows per call "
        f"({share}); plan run --check-parity compares with one device normalizing the same chunks"
    )
    return replace(plan, batch_stat_rows=rows, notes=(*plan.notes, note) if rows < plan.batch_size else plan.notes)


def _notes(
    graphs: MicrobatchGraphs, *, ddp: bool, runtime: RuntimeProfile, parameter_server: bool = False
) -> tuple[str, ...]:
    sync = (
        "gradient all-reduce: DDP's buckets, overlapped with the last backward as DDP runs them"
        if ddp
        else "gradient sync: each sharded stage's partial sums all-reduced in buckets, overlapped with its last "
        "backward (executors.parallel.grad_sync)"
    )
    if parameter_server:
        sync = "gradient sync: pushed to the parameter servers after the last backward (executors.parameter_server)"
    if runtime.grad_sync_after_backward:
        sync = f"gradient sync: one buffer per stage, all-reduced after its last backward ({runtime.name})"
    return (f"model captured {graphs.num_captures} time(s), other microbatch sizes interpolated", sync)


def _estimate_notes(setup: CostSetup, *, mfu: float, num_params: float) -> tuple[str, ...]:
    """What the estimate describes when not our executors, and an MFU above the best published one."""
    device = setup.cluster.device
    gemm = device.kernels.gemm_efficiency if device.kernels is not None else None
    above = mfu_bound_note(device_name=device.name, num_params=num_params, mfu=mfu, gemm_efficiency=gemm)
    return tuple(note for note in (setup.runtime.note(), above) if note)


def summary(plan: Plan, *, plan_path: str | None = None) -> str:
    """The summary ``plan`` prints for ``plan`` (its next steps name ``plan_path``, else ``PLAN.json``):
    ``print(planner.api.summary(plan))``."""
    return plan_summary(plan, plan_path=plan_path)
