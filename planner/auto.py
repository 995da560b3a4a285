"""``method="auto"``: the two-level search, checked against the hand-written plans it must beat.

1. :func:`planner.inter_op.search_pipeline`: per microbatch count, layer options (intra-op
   problem per layer kind and mesh) and the stage DP.
2. Candidates: the DP's plans of the :data:`DP_CANDIDATES` best microbatch counts, and the three
   best data-parallel, Megatron ``(t, p, d)`` and uniform-pipeline plans by the span options
   (:mod:`planner.baselines.handwritten`), priced as written (no refinement).
3. Each candidate is priced exactly on whole stages (:func:`planner.pipeline_plan.price_stages`);
   the fastest that fits is the plan. So the auto plan is never slower than a hand-written one
   under the same cost model, and its estimate is the exact price of what it returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from planner.baselines.handwritten import best_handwritten
from planner.errors import AutoplanError
from planner.estimate import GIB, CostSetup
from planner.graph import OpGraph
from planner.inter_op import LayerTables, PipelineOptions, Progress, search_pipeline
from planner.pipeline_plan import PricedPipeline, price_stages, specs_from_dp
from planner.rebatch import MicrobatchGraphs

DP_CANDIDATES = 3


@dataclass(frozen=True, kw_only=True)
class AutoResult:
    best: PricedPipeline
    chosen_by: str  # "stage-dp" or the hand-written method that won
    priced: dict[str, PricedPipeline]  # every candidate method's exact price
    num_solves: int
    ilp_s: float  # layer tables
    dp_s: float
    price_s: float


def auto_plan(
    graphs: MicrobatchGraphs,
    full_graph: OpGraph,
    setup: CostSetup,
    *,
    options: PipelineOptions,
    progress: Progress | None = None,
) -> AutoResult:
    """The fastest fitting plan of the search and of the hand-written methods; AutoplanError if none fits."""
    tables = LayerTables(setup, options)
    started = time.perf_counter()
    settings = search_pipeline(graphs, setup, tables, options=options, progress=progress)
    searched = time.perf_counter()
    search_dp_s = sum(s.stage_plan.dp_s for s in settings if s.stage_plan is not None)
    ranked = sorted((s for s in settings if s.stage_plan is not None), key=lambda s: s.stage_plan.step_time_s)
    candidates = [("stage-dp", s, specs_from_dp(s.stage_plan, s.spans, setup)) for s in ranked[:DP_CANDIDATES]]
    handwritten_started = time.perf_counter()
    for method, found in best_handwritten(settings, setup, remat=options.remat).items():
        candidates.extend((method, candidate.setting, list(candidate.specs)) for candidate in found)
    handwritten_s = time.perf_counter() - handwritten_started
    priced: dict[str, PricedPipeline] = {}
    for done, (method, setting, specs) in enumerate(candidates):
        if progress is not None:
            progress("pricing candidates", done, len(candidates))
        result = price_stages(full_graph=full_graph, graph=setting.graph, layers=setting.layers, tables=tables,
                              specs=specs, m=setting.num_microbatches, schedule=setting.schedule,
                              refine=method == "stage-dp")  # fmt: skip
        if result is not None and (
            method not in priced or result.estimate.step_time_s < priced[method].estimate.step_time_s
        ):
            priced[method] = result
    if not priced:
        failure = next((s.failure for s in reversed(settings) if s.failure), "")
        gib = setup.memory_budget_bytes / GIB
        raise AutoplanError(f"does not fit in {gib:.1f} GiB per device with any pipeline, sharding or recomputation"
                            + (f" ({failure})" if failure else "") + ": add devices, try --zero, or lower the batch")  # fmt: skip
    chosen_by = min(priced, key=lambda method: priced[method].estimate.step_time_s)
    return AutoResult(
        best=priced[chosen_by], chosen_by=chosen_by, priced=priced, num_solves=tables.num_solves,
        ilp_s=searched - started - search_dp_s, dp_s=search_dp_s + handwritten_s,
        price_s=time.perf_counter() - searched - handwritten_s,
    )  # fmt: skip
