"""The methods, by name: :data:`METHODS` maps each :class:`~planner.options.Method` to what it does and the
function that plans with it on a prepared model (:class:`planner.preparation.Prepared`).

``auto`` is the two-level search (:mod:`planner.auto`): pipeline stages on submeshes by DP, each operator's
sharding by the intra-op problem, microbatches, schedule and recomputation; ``data-parallel``, ``megatron`` and
``uniform-pipeline`` are the best hand-written plans of those kinds under the same cost model
(:mod:`planner.baselines.handwritten_plan`, the plans auto holds as its candidates); the placement baselines
(:mod:`planner.baselines.placement.methods`) put every operator on one device. Each function returns a
:class:`MethodRun`: the priced plan, its search statistics and notes; :func:`planner.api.plan_prepared` makes it
a validated plan.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from planner.auto import AutoResult, auto_plan
from planner.baselines.handwritten_plan import (
    HandwrittenResult,
    data_parallel_plan,
    handwritten_plan,
    megatron_at_scale,
)
from planner.baselines.method_options import does_not_fit_message
from planner.baselines.placement.methods import PLACEMENT_METHODS as PLACEMENT_DESCRIPTIONS
from planner.baselines.placement.methods import run_placement
from planner.errors import AutoplanError
from planner.inter.planning_input import PlanningInput
from planner.inter.stage_dp.solver import is_large
from planner.inter.stage_pricing import PricedPipeline
from planner.options import PLACEMENT_METHODS, Method
from planner.plan import SearchStats
from planner.preparation import Prepared


@dataclass(frozen=True, kw_only=True)
class MethodRun:
    """What a method found: its priced plan, its search statistics (``time_s``: this method's search) and notes."""

    chosen: PricedPipeline
    stats: SearchStats
    notes: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class AutoSearch:
    """Auto's search on a prepared model and its seconds: ``plan tune`` plans every candidate from one."""

    result: AutoResult
    seconds: float

    @property
    def stats(self) -> SearchStats:
        result = self.result
        return SearchStats(
            time_s=self.seconds,
            ilp_solves=result.num_solves,
            ilp_s=result.ilp_s,
            dp_s=result.dp_s,
            price_s=result.price_s,
        )


@dataclass(frozen=True, kw_only=True)
class PlanMethod:
    description: str
    run: Callable[[Prepared], MethodRun]


def search_auto(prepared: Prepared) -> AutoSearch:
    started = time.perf_counter()
    result = auto_plan(prepared.inputs)
    return AutoSearch(result=result, seconds=time.perf_counter() - started)


def auto_run(search: AutoSearch) -> MethodRun:
    """Auto's plan from its search: the pick, with every candidate's estimate in a note."""
    priced = sorted(search.result.priced.items())
    compared = ", ".join(f"{method} {p.estimate.step_time_s:.4g} s" for method, p in priced)
    notes = (f"compared under the same cost model: {compared}; chosen: {search.result.chosen_by}",)
    notes += tuple(f"left out: {reason}" for reason in search.result.left_out.values())
    return MethodRun(chosen=search.result.best, stats=search.stats, notes=notes)


def _auto(prepared: Prepared) -> MethodRun:
    return auto_run(search_auto(prepared))


HandwrittenRun = Callable[[PlanningInput], HandwrittenResult]


def _handwritten(method: Method, run: HandwrittenRun, prepared: Prepared) -> MethodRun:
    """A hand-written method alone: only the tables its configurations read; the plan ``auto`` holds as that
    method's candidate."""
    started = time.perf_counter()
    options = prepared.options
    found = run(prepared.inputs)
    if found.best is None:
        raise AutoplanError(
            does_not_fit_message(
                method,
                options,
                prepared.setup,
                found.least_memory_bytes,
                parts=found.least_memory_parts,
                batch_size=prepared.batch_size,
                num_params=prepared.graph.num_params,
            )
        )
    stats = SearchStats(
        time_s=time.perf_counter() - started,
        ilp_solves=found.num_solves,
        ilp_s=found.tables_s,
        dp_s=found.score_s,
        price_s=found.price_s,
    )
    note = f"stage problems priced: {found.stages_built} built, {found.stages_reused} reused by shape"
    return MethodRun(chosen=found.best, stats=stats, notes=(note,))


def _megatron(prepared: Prepared) -> MethodRun:
    """The Megatron grid; on a large cluster as an expert tries it there (:func:`megatron_at_scale`)."""
    at_scale = prepared.options.degrees is None and is_large(prepared.setup.cluster)
    run = megatron_at_scale if at_scale else partial(handwritten_plan, Method.MEGATRON)
    return _handwritten(Method.MEGATRON, run, prepared)


def _placement(method: Method, prepared: Prepared) -> MethodRun:
    options = prepared.options
    if options.grad_sync is not None and options.grad_sync.lossy:
        raise AutoplanError(f"--grad-sync {options.grad_sync.label}: op placements ({method}) sync no gradients")
    started = time.perf_counter()
    chosen, notes = run_placement(
        method,
        prepared.graphs,
        prepared.setup,
        batch_size=prepared.batch_size,
        microbatches=options.microbatches,
        rl_budget_s=options.rl_budget_s,
        rl_iterations=options.rl_iterations,
        seed=options.seed,
        progress=prepared.progress,
    )
    return MethodRun(chosen=chosen, stats=SearchStats(time_s=time.perf_counter() - started), notes=notes)


METHODS: dict[Method, PlanMethod] = {
    Method.AUTO: PlanMethod(
        description="the best plan autoplan can search: pipeline stages by DP, per-operator sharding by ILP, "
        "microbatches, schedule and recomputation",
        run=_auto,
    ),
    Method.DATA_PARALLEL: PlanMethod(
        description="every device holds the model and a 1/d slice of the batch",
        run=partial(_handwritten, Method.DATA_PARALLEL, data_parallel_plan),
    ),
    Method.MEGATRON: PlanMethod(
        description="the best Megatron (tensor, pipeline, data) grid point, priced like auto (--degrees: one point)",
        run=_megatron,
    ),
    Method.UNIFORM_PIPELINE: PlanMethod(
        description="equal layers per stage on equal submeshes, each stage sharded by ILP",
        run=partial(_handwritten, Method.UNIFORM_PIPELINE, partial(handwritten_plan, Method.UNIFORM_PIPELINE)),
    ),
    **{
        method: PlanMethod(description=PLACEMENT_DESCRIPTIONS[method], run=partial(_placement, method))
        for method in PLACEMENT_METHODS
    },
}
