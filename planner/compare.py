"""``plan compare``: every method on the same model and cluster, each by the one estimate it prints.

Each method (:data:`COMPARE_METHODS`) makes its plan on one prepared model (:func:`planner.api.plan_prepared`:
one capture, one cost setup, one :class:`planner.options.PlanOptions`). A row's step time and memory per device
are the plan's estimate — the numbers ``plan``, ``plan show`` and the JSON print for it, and the ones ``auto``
chose by — so the data-parallel, Megatron and uniform-pipeline rows equal the candidates auto's "why this plan"
lists. Each plan is also replayed by the discrete-event simulator (:func:`planner.costing.lowering.simulate_plan`)
on the graph at its microbatch size, as a check of the estimate: ``simulated_step_time_s`` beside it. Each row's
pipeline bubble is its plan's (:func:`cost_models.simulator.bubble_fraction`).

Where a method's estimate and the replay differ by more than :data:`GAP_LIMIT`, the row
says why (:func:`explain_gap`): it re-simulates without cross-stage transfers and without the
end-of-step gradient sync and optimizer update, and names what moves the step most.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cost_models.simulator import SimResult
from cost_models.units import GIB
from planner.api import METHODS, Prepared, plan_prepared
from planner.costing.lowering import lower_plan, simulate_lowered
from planner.errors import AutoplanError
from planner.options import Method
from planner.plan import Plan
from planner.plan.schedules import Schedule

COMPARE_METHODS = (
    Method.AUTO,
    Method.MEGATRON,
    Method.UNIFORM_PIPELINE,
    Method.DATA_PARALLEL,
    Method.HASH,
    Method.CRITICAL_PATH,
    Method.MULTI_OBJECTIVE,
    Method.M_ETF,
    Method.RL,
)
GAP_LIMIT = 0.10
MEMORY_SLACK = 1e-6  # relative: rounding between the planner's sums and the simulator's


@dataclass(frozen=True, kw_only=True)
class ComparisonRow:
    """One method's row; its plan's figures are None when the method found no plan (``note`` says why)."""

    method: str
    fits: bool
    search_time_s: float
    step_time_s: float | None = None  # the plan's estimate
    simulated_step_time_s: float | None = None  # the discrete-event replay of the plan (a check of the estimate)
    memory_per_device_bytes: float | None = None  # the plan's estimate for its fullest device
    simulated_memory_bytes: float | None = None  # the replay's peak on the fullest device
    bubble_fraction: float | None = None  # the plan's pipeline bubble (its estimate's), as plan and plan show print it
    note: str = ""
    plan: Plan | None = None

    def to_json(self, *, best_s: float | None = None) -> dict[str, Any]:
        return {
            "method": self.method,
            "step_time_s": self.step_time_s,
            "memory_per_device_bytes": self.memory_per_device_bytes,
            "fits": self.fits,
            "search_time_s": self.search_time_s,
            "simulated_step_time_s": self.simulated_step_time_s,
            "simulated_memory_bytes": self.simulated_memory_bytes,
            "bubble_fraction": self.bubble_fraction,
            "times_best": self.step_time_s / best_s if best_s and self.step_time_s else None,
            "note": self.note,
        }


def parse_methods(text: str | None) -> tuple[Method, ...]:
    """``--methods A,B,...`` as methods (default :data:`COMPARE_METHODS`); AutoplanError naming an unknown one."""
    if not text:
        return COMPARE_METHODS
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in METHODS]
    if unknown or not names:
        raise AutoplanError(f"--methods: unknown method {unknown[0] if unknown else text!r}: use {', '.join(METHODS)}")
    return tuple(Method(name) for name in names)


def compare(
    prepared: Prepared,
    methods: Sequence[Method | str] = COMPARE_METHODS,
    *,
    progress: Callable[[str], None] | None = None,
) -> list[ComparisonRow]:
    """One row per method, in the order given."""
    rows = []
    for method in methods:
        if progress is not None:
            progress(method)
        rows.append(_row(prepared, method))
    return rows


def best_step_s(rows: Sequence[ComparisonRow]) -> float | None:
    times = [row.step_time_s for row in rows if row.fits and row.step_time_s is not None]
    return min(times) if times else None


def _row(prepared: Prepared, method: Method | str) -> ComparisonRow:
    started = time.perf_counter()
    try:
        plan = plan_prepared(prepared, method)
    except AutoplanError as error:
        return ComparisonRow(method=method, fits=False, search_time_s=time.perf_counter() - started, note=str(error))
    setup = prepared.setup
    graph = prepared.graphs.at(plan.batch_size // plan.num_microbatches)
    lowered = lower_plan(plan, graph, setup)
    result = simulate_lowered(lowered)
    budget = setup.memory_budget_bytes * (1 + MEMORY_SLACK)
    note = explain_gap(plan, result, lambda **off: simulate_lowered(lowered, **off).step_time_s, lowered.totals_s)
    if result.max_memory_bytes > budget:
        note = (
            f"the replay peaks at {result.max_memory_bytes / GIB:.2f} GiB, over the "
            f"{setup.memory_budget_bytes / GIB:.2f} GiB budget; " + note
        ).rstrip("; ")
    return ComparisonRow(
        method=method,
        fits=plan.estimate.memory_per_device_bytes <= budget,
        step_time_s=plan.estimate.step_time_s,
        simulated_step_time_s=result.step_time_s,
        memory_per_device_bytes=plan.estimate.memory_per_device_bytes,
        simulated_memory_bytes=result.max_memory_bytes,
        bubble_fraction=plan.estimate.bubble_fraction,
        search_time_s=plan.search.time_s,
        note=note,
        plan=plan,
    )


def explain_gap(
    plan: Plan, result: SimResult, resimulate: Callable[..., float], totals_s: Mapping[str, float] | None = None
) -> str:
    """Empty when estimate and simulation agree within GAP_LIMIT; else what makes them differ."""
    estimate, simulated = plan.estimate.step_time_s, result.step_time_s
    if estimate <= 0 or abs(simulated / estimate - 1) <= GAP_LIMIT:
        return ""
    effects = {
        "cross-stage transfers on their own links": simulated - resimulate(include_transfers=False),
        "gradient sync and optimizer update once at the end of the step": simulated - resimulate(include_step=False),
    }
    parts = [f"simulated {simulated:.4g} s vs estimated {estimate:.4g} s ({simulated / estimate - 1:+.0%})"]
    for what, seconds in sorted(effects.items(), key=lambda item: -abs(item[1])):
        if abs(seconds) > 0.01 * simulated:
            parts.append(f"{what} add {seconds:.3g} s to the simulated step")
    charged = {key: value for key, value in plan.estimate.breakdown_s.items() if value}
    if len(plan.stages) == 1 and totals_s and charged:
        mine = ", ".join(f"{key.removesuffix('_s').replace('_', ' ')} {value:.3g} s" for key, value in charged.items())
        ops = ", ".join(f"{key.removesuffix('_s')} {value:.3g} s" for key, value in totals_s.items())
        parts.append(
            f"the estimate charges {mine}; the simulated operators charge {ops} (their own collectives "
            "and resharding, which the method's formula leaves out)"
        )
    if plan.num_microbatches > 1 and len(plan.stages) > 1 and plan.schedule != Schedule.DATAFLOW:
        parts.append(
            "the estimate is Σt + (m−1)·max t with the sync amortised per microbatch and transfers inside stage "
            "times; the simulator runs the schedule's forward and backward tasks one by one"
        )
    return "; ".join(parts)
