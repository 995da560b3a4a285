"""``method="auto"``: the two-level search, checked against the hand-written plans it must beat.

1. :func:`planner.inter.search.search_pipeline`: per microbatch count, layer options (intra-op
   problem per layer kind and mesh) and the stage DP.
2. Candidates: the DP's plans of the :data:`DP_CANDIDATES` best microbatch counts, and the three
   best data-parallel, Megatron ``(t, p, d)`` and uniform-pipeline plans by the span options
   (:func:`planner.baselines.handwritten.best_handwritten`, with ``--allow-lossy`` also every Megatron grid point
   whose data-parallel groups cross nodes), priced as written (no refinement). On a large cluster
   (:func:`planner.inter.stage_dp.solver.is_large`) the Megatron candidate is the grid as an expert tries it
   there — deep pipelines on whole layers, hundreds of microbatches
   (:func:`planner.baselines.handwritten_plan.megatron_at_scale`).
3. Each candidate is priced exactly on whole stages (:func:`planner.inter.pricing.price_stages`), under the
   fastest gradient sync the options offer; Megatron's pipelines are also tried under its interleaved 1F1B, as
   run alone, and the fastest pipelines of every method under interleaved 1F1B and zero bubble make the
   ``rescheduled`` candidate (:func:`_add_schedule_variants`, priced by replaying the schedule); the one-microbatch
   data-parallel plan replaces the grid's data-parallel candidate when faster
   (:func:`planner.baselines.handwritten_plan.pure_data_parallel`). ``--schedule interleaved`` or ``zero-bubble``
   keeps only the pipelines under that schedule. CPU offload (``--offload``): the offloaded data-parallel plan
   is the candidate when no other fits, or the only one under ``--offload on``
   (:func:`planner.baselines.offloaded.with_offload`). The DP's memory per stage is an estimate: when none of its
   plans fits once priced exactly, the DP's plans of the other microbatch counts are priced (:func:`_price_further_dp`),
   then the DP runs again under :data:`TIGHTER_SHARES` of the budget (:func:`_retry_tighter_dp`, said in a note).
4. The plan is the candidate with the least estimate — the figure the summary, ``plan show``, ``plan compare``
   and the JSON print. The data-parallel, Megatron and uniform-pipeline candidates are the plans those methods
   return run alone (the same functions on the same tables), so auto is never slower than any of them by
   construction, and "why this plan" lists exactly their estimates.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from cost_models.units import GIB
from planner.baselines.handwritten import HANDWRITTEN, best_handwritten, least_memory
from planner.baselines.handwritten_plan import megatron_at_scale, pure_data_parallel, smallest_plan_memory
from planner.baselines.method_options import (
    advice_text,
    fit_advice,
    gib_text,
    parts_text,
    state_too_large_message,
)
from planner.baselines.offloaded import offload_hint, with_offload
from planner.costing.setup import CostSetup
from planner.errors import AutoplanError
from planner.inter.planning_input import PlanningInput
from planner.inter.pricing import specs_from_dp
from planner.inter.runnable_rows import rows_refusal
from planner.inter.schedule_variants import (
    Candidate,
    Pipelines,
    best_rescheduled,
    method_schedules,
    price_candidates,
    with_variant,
)
from planner.inter.search import LayerTables, PipelineChoice, search_pipeline
from planner.inter.stage_dp.solver import is_large
from planner.inter.stage_pricing import PricedPipeline
from planner.ir.graph import OpGraph
from planner.options import Method, PlanOptions, RematChoice
from planner.plan.schedules import MULTI_STAGE_SCHEDULES

DP_CANDIDATES = 3
TIGHTER_SHARES = (0.97, 0.94, 0.91)  # the budget shares the stage DP is retried under when none of its plans fit
STAGE_DP = "stage-dp"  # the candidates of the stage DP (auto's own), beside the hand-written methods' names


def _add_megatron_at_scale(
    priced: dict[str, PricedPipeline], graph_of: dict[str, OpGraph], inputs: PlanningInput
) -> None:
    """On a large cluster the Megatron candidate is :func:`megatron_at_scale`'s (deep pipelines, hundreds of
    microbatches: Megatron's published configurations), as ``--method megatron`` runs it there."""
    found = megatron_at_scale(inputs)
    if found.best is not None and found.graph is not None:
        priced[Method.MEGATRON], graph_of[Method.MEGATRON] = found.best, found.graph


def _add_pure_data_parallel(
    priced: dict[str, PricedPipeline], graph_of: dict[str, OpGraph], inputs: PlanningInput
) -> None:
    """The one-microbatch data-parallel plan replaces the grid's data-parallel candidate when it is faster, as
    ``--method data-parallel`` chooses (:func:`planner.baselines.handwritten_plan.data_parallel_plan`)."""
    pure = pure_data_parallel(inputs)
    current = priced.get(Method.DATA_PARALLEL)
    if pure is not None and (current is None or pure.estimate.step_time_s < current.estimate.step_time_s):
        priced[Method.DATA_PARALLEL], graph_of[Method.DATA_PARALLEL] = pure, inputs.full_graph


def _add_offloaded(priced: dict[str, PricedPipeline], graph_of: dict[str, OpGraph], inputs: PlanningInput) -> None:
    """CPU offload (:func:`planner.baselines.offloaded.with_offload`): with ``--offload on`` the offloaded
    data-parallel plan is the only candidate; with ``auto`` it is added only when no candidate fits."""
    fitting = min(priced.values(), key=lambda found: found.estimate.step_time_s) if priced else None
    chosen = with_offload(fitting, inputs)
    if chosen is not fitting:
        priced.clear()
        if chosen is not None:
            priced[Method.DATA_PARALLEL], graph_of[Method.DATA_PARALLEL] = chosen, inputs.full_graph


def _add_schedule_variants(
    priced: dict[str, PricedPipeline],
    graph_of: dict[str, OpGraph],
    pipelines: dict[str, Pipelines],
    *,
    full_graph: OpGraph,
    tables: LayerTables,
    mode: str,
) -> None:
    """Each hand-written method's plan with its own schedule variants (Megatron: interleaved; as it is run alone),
    and the ``rescheduled`` candidate: the fastest pipelines of every method under every variant schedule
    (:mod:`planner.inter.schedule_variants`). A named multi-stage schedule keeps only the plans that use it."""
    for method in (Method.MEGATRON, Method.UNIFORM_PIPELINE):
        try:
            schedules = method_schedules(method, mode)
        except AutoplanError:  # not one of the method's schedules: the rescheduled candidate may still use it
            schedules = ()
        found = best_rescheduled(pipelines.get(method, []), full_graph=full_graph, tables=tables, schedules=schedules)
        best = with_variant(priced.get(method), found, mode=mode)
        if found is not None and best is found[0]:
            priced[method], graph_of[method] = best, found[1].setting.graph
    everything = [entry for entries in pipelines.values() for entry in entries]
    found = best_rescheduled(
        everything, full_graph=full_graph, tables=tables, schedules=method_schedules("rescheduled", mode)
    )
    if found is not None:
        priced["rescheduled"], graph_of["rescheduled"] = found[0], found[1].setting.graph
    if mode in MULTI_STAGE_SCHEDULES:
        for method in [method for method, plan in priced.items() if plan.schedule != mode]:
            del priced[method]


def _does_not_fit(settings: list[PipelineChoice], tables: LayerTables, *, batch_size: int) -> str:
    """Why no candidate fits: the model state alone (:func:`state_too_large_message`), or what the smallest
    hand-written plan under the asked choices needs and the changes that fit it by its estimate
    (:func:`planner.baselines.method_options.fit_advice`)."""
    setup, options = tables.setup, tables.options
    state = state_too_large_message(setup, settings[0].graph.num_params) if settings else None
    if state is not None:
        return state
    failure = next((s.failure for s in reversed(settings) if s.failure), "")
    found = [least_memory(settings, setup, options=options, method=method) for method in HANDWRITTEN]
    smallest = min((c for c in found if c is not None), key=lambda c: c.memory_bytes, default=None)
    needed, parts = (0.0, None) if smallest is None else smallest_plan_memory(smallest, tables)
    choices = options.asked_choices()
    text = f"does not fit in {setup.memory_budget_bytes / GIB:.1f} GiB per device with any pipeline, sharding or "
    text += "recomputation" + (f" under {choices}" if choices else "")
    if smallest is not None:
        text += (
            f": the smallest data-parallel, Megatron or uniform-pipeline plan (a {smallest.method} plan) needs "
            f"{gib_text(needed)} GiB{parts_text(parts)}"
        )
    text += f" ({failure})" if failure else ""
    if smallest is None:
        return f"{text}: add devices, lower the batch" + ("" if choices else ", or try --zero")
    advice = fit_advice(smallest.method, options, setup, parts=parts, batch_size=batch_size)
    generic = "add devices, lower the batch" + ("" if choices else ", or try --zero")
    return f"{text}: {advice_text(advice, otherwise=generic)}"


@dataclass(frozen=True, kw_only=True)
class AutoResult:
    best: PricedPipeline
    chosen_by: str  # "stage-dp" or the hand-written method that won
    priced: dict[str, PricedPipeline]  # every candidate method's exact price
    left_out: dict[str, str]  # candidates priced, then left out because their ranks could not run them: why
    num_solves: int
    ilp_s: float  # layer tables
    dp_s: float
    price_s: float


def auto_plan(inputs: PlanningInput) -> AutoResult:
    """The fastest fitting plan of the search and of the hand-written methods; AutoplanError if none fits."""
    setup, options, full_graph, progress = inputs.setup, inputs.options, inputs.full_graph, inputs.progress
    tables = LayerTables(setup, options)
    started = time.perf_counter()
    search = search_pipeline(inputs.graphs, setup, tables, options=options, progress=progress)
    settings, search_dp_s = search.choices, search.dp_s
    searched = time.perf_counter()
    at_scale = is_large(setup.cluster) and options.degrees is None  # Megatron's candidate: as run alone there
    candidates = _candidates(settings, setup, options=options, at_scale=at_scale)
    handwritten_s = time.perf_counter() - searched
    priced, graph_of, pipelines = price_candidates(candidates, full_graph=full_graph, tables=tables, progress=progress)
    if STAGE_DP not in priced:  # the DP's best microbatch counts did not fit once priced exactly: try the others
        _price_further_dp(
            settings, priced=priced, graph_of=graph_of, pipelines=pipelines, tables=tables, full_graph=full_graph
        )
    if STAGE_DP not in priced and any(s.stage_plan is not None for s in settings):
        _retry_tighter_dp(inputs, priced=priced, graph_of=graph_of, pipelines=pipelines)
    _add_schedule_variants(priced, graph_of, pipelines, full_graph=full_graph, tables=tables, mode=options.schedule)
    if at_scale:
        _add_megatron_at_scale(priced, graph_of, inputs)
    _add_pure_data_parallel(priced, graph_of, inputs)
    _add_offloaded(priced, graph_of, inputs)
    left_out = _left_out_unrunnable(priced, inputs)
    if not priced and options.schedule in MULTI_STAGE_SCHEDULES:
        raise AutoplanError(
            f"no pipeline fits under --schedule {options.schedule} (it needs at least two stages of "
            "equal size and, for interleaved, twice as many layers): try --schedule auto"
        )
    if not priced and left_out:
        raise AutoplanError(next(iter(left_out.values())))
    if not priced:
        raise AutoplanError(_does_not_fit(settings, tables, batch_size=inputs.graphs.batch_size) + offload_hint(inputs))
    chosen_by = min(priced, key=lambda method: priced[method].estimate.step_time_s)  # the figure every command prints
    return AutoResult(
        best=priced[chosen_by],
        chosen_by=chosen_by,
        priced=priced,
        left_out=left_out,
        num_solves=tables.num_solves,
        ilp_s=searched - started - search_dp_s,
        dp_s=search_dp_s + handwritten_s,
        price_s=time.perf_counter() - searched - handwritten_s,
    )


def _price_further_dp(
    settings: list[PipelineChoice],
    *,
    priced: dict[str, PricedPipeline],
    graph_of: dict[str, OpGraph],
    pipelines: dict[str, Pipelines],
    tables: LayerTables,
    full_graph: OpGraph,
) -> None:
    """The DP's plans of the microbatch counts after the :data:`DP_CANDIDATES` best, priced exactly one by one
    (fastest first by the DP's estimate) until one fits: the DP's estimate of a stage's memory is approximate, so a
    fitting plan may rank below three that do not (a tighter budget once found one that a looser one did not)."""
    ranked = sorted((s for s in settings if s.stage_plan is not None), key=lambda s: s.stage_plan.step_time_s)
    for setting in ranked[DP_CANDIDATES:]:
        found = _priced_dp_plan(setting, tables=tables, full_graph=full_graph)
        if found is not None:
            _merge(found, priced=priced, graph_of=graph_of, pipelines=pipelines)
            return


def _retry_tighter_dp(
    inputs: PlanningInput,
    *,
    priced: dict[str, PricedPipeline],
    graph_of: dict[str, OpGraph],
    pipelines: dict[str, Pipelines],
) -> None:
    """The DP run again until one of its plans fits once priced exactly: under :data:`TIGHTER_SHARES` of the memory
    budget (priced against that share, so it fits the whole budget), then — when the user left recomputation to the
    search — with every stage recomputed in full. The DP's memory per stage is an estimate, below the exact price
    in places, and it keeps one plan per microbatch count, so at the edge of the budget every plan it returns may
    be over while a slower one fits. The plan says which retry found it, in a note."""
    for setup, options, note in _retries(inputs):
        tables = LayerTables(setup, options)
        search = search_pipeline(inputs.graphs, setup, tables, options=options, progress=inputs.progress)
        ranked = sorted((s for s in search.choices if s.stage_plan is not None), key=lambda s: s.stage_plan.step_time_s)
        for setting in ranked[:DP_CANDIDATES]:
            found = _priced_dp_plan(setting, tables=tables, full_graph=inputs.full_graph)
            if found is not None:
                _merge(found, priced=priced, graph_of=graph_of, pipelines=pipelines, note=note)
                return


_Priced = tuple[dict[str, PricedPipeline], dict[str, OpGraph], dict[str, Pipelines]]


def _priced_dp_plan(setting: PipelineChoice, *, tables: LayerTables, full_graph: OpGraph) -> _Priced | None:
    """One of the stage DP's plans priced exactly (with its refined specs); None when it does not fit."""
    specs = tuple(specs_from_dp(setting.stage_plan, setting.spans, tables.setup))
    found = price_candidates(
        [(STAGE_DP, Candidate(setting=setting, specs=specs, refine=True))],
        full_graph=full_graph,
        tables=tables,
        progress=None,
    )
    return found if STAGE_DP in found[0] else None


def _merge(
    found: _Priced,
    *,
    priced: dict[str, PricedPipeline],
    graph_of: dict[str, OpGraph],
    pipelines: dict[str, Pipelines],
    note: str | None = None,
) -> None:
    """A priced stage-DP plan joins auto's candidates (``note``: the retry that found it, for the plan's notes)."""
    more, more_graphs, more_pipelines = found
    if note is not None:
        more = {**more, STAGE_DP: replace(more[STAGE_DP], notes=(*more[STAGE_DP].notes, note))}
    priced.update(more)
    graph_of.update(more_graphs)
    for key, found_pipelines in more_pipelines.items():
        pipelines.setdefault(key, []).extend(found_pipelines)


def _retries(inputs: PlanningInput) -> list[tuple[CostSetup, PlanOptions, str]]:
    """The setups and options :func:`_retry_tighter_dp` runs the DP under, each with the note its plan carries."""
    setup, options = inputs.setup, inputs.options
    whole = "under the whole budget the stage DP's plans did not fit once priced exactly"
    retries = [
        (
            replace(setup, memory_fraction=setup.memory_fraction * share),
            options,
            f"the stage DP planned under {share:.0%} of the memory budget: {whole}",
        )
        for share in TIGHTER_SHARES
    ]
    if options.remat in (RematChoice.AUTO, RematChoice.OFF_OR_FULL):
        share = f"{TIGHTER_SHARES[-1]:.0%}"
        note = f"the stage DP planned with full recomputation on every stage: {whole}, nor under {share} of it"
        retries.append((setup, replace(options, remat=RematChoice.ON), note))
    return retries


def _left_out_unrunnable(priced: dict[str, PricedPipeline], inputs: PlanningInput) -> dict[str, str]:
    """Take out of ``priced`` the candidates whose ranks would run another graph than the plan's
    (:func:`planner.inter.runnable_rows.rows_refusal`); returns why, by candidate."""
    left_out = {}
    for name, candidate in list(priced.items()):
        refusal = rows_refusal(
            stages=candidate.stages,
            num_microbatches=candidate.num_microbatches,
            graphs=inputs.graphs,
            what=f"auto's {name} candidate",
        )
        if refusal is not None:
            left_out[name] = refusal
            del priced[name]
    return left_out


def _candidates(
    settings: list[PipelineChoice], setup: CostSetup, *, options: PlanOptions, at_scale: bool
) -> list[tuple[str, Candidate]]:
    """The DP's plans of the :data:`DP_CANDIDATES` best microbatch counts, then the best hand-written plans (the
    Megatron grid left out at scale: :func:`_add_megatron_at_scale` adds it as run there)."""
    ranked = sorted((s for s in settings if s.stage_plan is not None), key=lambda s: s.stage_plan.step_time_s)
    candidates = [
        (STAGE_DP, Candidate(setting=s, specs=tuple(specs_from_dp(s.stage_plan, s.spans, setup)), refine=True))
        for s in ranked[:DP_CANDIDATES]
    ]
    methods = tuple(method for method in HANDWRITTEN if not (at_scale and method == Method.MEGATRON))
    for method, found in best_handwritten(settings, setup, options=options, methods=methods).items():
        candidates += [(method, Candidate(setting=c.setting, specs=c.specs, refine=False)) for c in found]
    return candidates
