"""``plan tune``'s decisions: which candidates to run, which measured plan to keep, and what to learn from them.

* **Candidates** (:func:`candidate_names`): auto's pick first, then the best plan of each other family auto
  priced — data parallel (DDP/FSDP), the Megatron grid, uniform pipelines — then auto's other candidates (the
  stage DP's, the rescheduled pipeline) by estimate; distinct plans only (the same stages, microbatches and
  schedule count once), at most ``count``.
* **Keep rule** (:func:`choose`): the candidate with the least measured step among those that ran and whose
  measured peak on every rank fits the plan's memory budget; a candidate that failed (an error, out of memory, a
  time-out) is reported and skipped. The rule reads only measurements.
* **What it learns** (:func:`learn`): each candidate's estimate split into its time components by re-pricing the
  plan with one component scaled (:func:`component_seconds`: the simulator's replay of the stored plan, whose
  slope in a component's factor is that component's seconds), and the correction factors fitted to the measured
  steps and peaks (:func:`cost_models.corrections.fit_corrections`); ``plan tune`` writes them into the
  cluster's cached calibration so the next ``plan`` on that cluster starts closer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cost_models.cluster import Cluster
from cost_models.compute import ProfiledCompute, RooflineCompute
from cost_models.corrections import (
    TIME_COMPONENTS,
    CorrectionRow,
    Corrections,
    fit_corrections,
    scale_component,
)
from planner.auto import AutoResult
from planner.costing.lowering import lower_plan, simulate_lowered
from planner.costing.setup import CostSetup
from planner.ir.graph import OpGraph
from planner.options import HANDWRITTEN_METHODS
from planner.plan import Plan

FAMILIES = HANDWRITTEN_METHODS
DEFAULT_CANDIDATES = 4
SLOPE = 0.05  # the relative change of a component's factor used to measure its seconds in an estimate


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """What running one candidate gave: the median step (None when it failed), each rank's peak bytes, why it
    failed, and the share of the machine other work took while it ran."""

    step_time_s: float | None
    peak_memory_bytes: tuple[float, ...] = ()
    error: str | None = None
    disturbance: float = 0.0

    @property
    def ran(self) -> bool:
        return self.step_time_s is not None and self.error is None


@dataclass(frozen=True, kw_only=True)
class TuneRow:
    name: str  # auto's candidate name: stage-dp, data-parallel, megatron, uniform-pipeline, rescheduled
    plan: Plan
    measurement: Measurement
    fits: bool  # the measured peak of every rank within the plan's budget

    @property
    def estimate_s(self) -> float:
        return self.plan.estimate.step_time_s


@dataclass(frozen=True, kw_only=True)
class TuneResult:
    rows: tuple[TuneRow, ...]
    chosen: int  # the kept row (its plan is ``plan``)
    plan: Plan  # the kept candidate's plan, its notes saying why
    corrections: Corrections
    auto_name: str  # auto's pick, the first row


def candidate_names(result: AutoResult, *, count: int = DEFAULT_CANDIDATES) -> list[str]:
    """Auto's candidates to run, in order (module docstring); distinct by stages, microbatches and schedule."""
    others = sorted(
        (name for name in result.priced if name not in FAMILIES and name != result.chosen_by),
        key=lambda name: result.priced[name].estimate.step_time_s,
    )
    order = [result.chosen_by, *(name for name in FAMILIES if name in result.priced), *others]
    names: list[str] = []
    seen: set[tuple] = set()
    for name in order:
        priced = result.priced[name]
        stages = json.dumps([stage.to_json() for stage in priced.stages], sort_keys=True)
        key = (stages, priced.num_microbatches, priced.schedule, priced.grad_sync.label)
        if name in names or key in seen:
            continue
        names.append(name)
        seen.add(key)
        if len(names) == count:
            break
    return names


def fits(plan: Plan, measurement: Measurement) -> bool:
    """Every rank's measured peak within the plan's memory budget (no peak measured: judged by the estimate)."""
    return all(peak <= plan.memory_budget_bytes for peak in measurement.peak_memory_bytes)


def choose(rows: Sequence[TuneRow]) -> int | None:
    """The row with the least measured step among those that ran and fit (the earlier on a tie); None if none."""
    usable = [index for index, row in enumerate(rows) if row.measurement.ran and row.fits]
    return min(usable, key=lambda index: (rows[index].measurement.step_time_s, index), default=None)


def _on_cluster(setup: CostSetup, cluster: Cluster) -> CostSetup:
    """``setup`` re-priced on ``cluster``: its roofline, or the same measured times with its slowdown."""
    roofline = RooflineCompute(device=cluster.device)
    if isinstance(setup.compute, ProfiledCompute):
        compute = replace(setup.compute, fallback=roofline, slowdown=cluster.device.shared_slowdown)
        return replace(setup, cluster=cluster, compute=compute)
    return replace(setup, cluster=cluster, compute=roofline)


def component_seconds(plan: Plan, graph: OpGraph, setup: CostSetup) -> dict[str, float]:
    """The seconds of each time component in the plan's step: the replay's slope in the component's factor at 1
    (``graph``: the model at the plan's microbatch size)."""
    base = simulate_lowered(lower_plan(plan, graph, setup)).step_time_s
    seconds = {}
    for component in TIME_COMPONENTS:
        scaled = _on_cluster(setup, scale_component(setup.cluster, component, 1.0 + SLOPE))
        changed = simulate_lowered(lower_plan(replace(plan, cluster=scaled.cluster), graph, scaled)).step_time_s
        seconds[component] = max(0.0, (changed - base) / SLOPE)
    return seconds


def learn(rows: Sequence[TuneRow], graph_at, setup: CostSetup) -> Corrections:
    """The correction factors the measured candidates support (module docstring); ``graph_at(b)``: the model's
    graph at batch ``b``."""
    fitted = []
    for row in rows:
        measured = row.measurement
        if not measured.ran:
            continue
        plan = row.plan
        graph = graph_at(plan.batch_size // plan.num_microbatches)
        fitted.append(
            CorrectionRow(
                estimate_s=plan.estimate.step_time_s,
                components_s=component_seconds(plan, graph, setup),
                measured_s=float(measured.step_time_s),
                estimated_memory_bytes=plan.estimate.memory_per_device_bytes,
                measured_memory_bytes=max(measured.peak_memory_bytes, default=0.0),
            )
        )
    return fit_corrections(fitted)


def tuned_plan(rows: Sequence[TuneRow], chosen: int) -> Plan:
    """The kept candidate's plan, its notes saying what was measured against what."""
    row = rows[chosen]
    measured = row.measurement.step_time_s
    assert measured is not None and math.isfinite(measured)
    auto = rows[0]
    versus = (
        "auto's pick itself"
        if chosen == 0
        else f"auto's pick ({auto.name}) measured "
        + (
            f"{auto.measurement.step_time_s * 1e3:.1f} ms"
            if auto.measurement.ran
            else f"nothing ({auto.measurement.error})"
        )
    )
    note = (
        f"plan tune kept this candidate ({row.name}): measured {measured * 1e3:.1f} ms a step against its estimate "
        f"{row.estimate_s * 1e3:.1f} ms, the fastest of {sum(r.measurement.ran for r in rows)} measured candidates; "
        f"{versus}"
    )
    return replace(row.plan, notes=(*row.plan.notes, note))
