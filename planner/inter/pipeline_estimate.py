"""A priced candidate's estimate: its step in non-negative parts, its memory, bubble and model FLOPs.

The parts are those of ``T = Σ t_s + (m − 1)·P + U + w + o`` (:mod:`planner.inter.pricing`): one stage and one
microbatch as its operators' compute, collectives, resharding and recomputation; otherwise the steady state
``m·P`` and the fill and drain ``Σ t_s − P``; then ``U``, the tied weights' sync ``w`` and the host's ``o``. A plan run
as DDP or FSDP keeps its own parts (:class:`planner.costing.ddp.DdpStep`). The bubble is
:func:`cost_models.simulator.bubble_fraction` of the pipeline phase.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cost_models.simulator import bubble_fraction
from planner.costing.ddp import DdpStep
from planner.costing.estimate import mfu, model_tflops_per_device
from planner.costing.setup import CostSetup
from planner.inter.stage_pricing import PricedStage
from planner.ir.graph import OpGraph
from planner.plan import Estimate


def _nonnegative(value: float, *, scale: float, what: str) -> float:
    """``value`` with float rounding below zero taken off; an internal error when it is truly negative."""
    assert value >= -1e-9 * max(scale, 1e-12), f"internal error (please report): {what} is {value!r} s"
    return max(0.0, value)


@dataclass(frozen=True, kw_only=True)
class StepTiming:
    """A candidate's step ``T`` and its pipeline phase (module docstring): the stage times ``t_s``, ``m``
    microbatches, the steady-state period ``P`` and the tied weights' sync ``w``."""

    step_s: float
    times: tuple[float, ...]
    m: int
    period_s: float
    tied_s: float = 0.0

    @property
    def phase_s(self) -> float:
        """The pipeline phase ``Σ t_s + (m − 1)·P``."""
        return math.fsum(self.times) + (self.m - 1) * self.period_s


def _pipeline_breakdown(setup: CostSetup, priced: list[PricedStage], timing: StepTiming) -> dict[str, float]:
    """The parts of ``T = Σ t_s + (m − 1)·P + U + w + o`` (module docstring), each non-negative: one stage and one
    microbatch as its operators' compute, collectives, resharding and recomputation; otherwise the steady state
    ``m·P`` and the fill and drain ``Σ t_s − P``. ``U`` is what the step has past the pipeline phase."""
    step, times, tied_s = timing.step_s, timing.times, timing.tied_s
    overhead = setup.cluster.device.step_overhead_s
    after = _nonnegative(
        step - timing.phase_s - tied_s - overhead, scale=step, what="the sync after the pipeline phase"
    )
    if len(times) == 1 and timing.m == 1:
        rows = priced[0].stage.explanation
        work = {
            "compute_s": math.fsum(r.compute_s for r in rows),
            "comm_s": math.fsum(r.comm_s for r in rows),
            "reshard_s": math.fsum(r.reshard_s for r in rows),
        }
        recompute = _nonnegative(times[0] - math.fsum(work.values()), scale=step, what="recomputation")
        parts = {**work, "recompute_s": recompute}
    else:
        fill = _nonnegative(math.fsum(times) - timing.period_s, scale=step, what="the fill and drain")
        parts = {"steady_s": timing.m * timing.period_s, "fill_and_drain_s": fill}
    return {
        **parts,
        "grad_sync_and_optimizer_s": after,
        **({"tied_grad_sync_s": tied_s} if tied_s else {}),
        "host_overhead_s": overhead,
    }


def pipeline_estimate(
    graph: OpGraph, setup: CostSetup, priced: list[PricedStage], timing: StepTiming, *, ddp: DdpStep | None = None
) -> Estimate:
    """The candidate's estimate: its step with its parts (:func:`_pipeline_breakdown`, or DDP's or FSDP's own when
    ``ddp`` holds how it runs), the stage times, the largest stage memory and the bubble."""
    num_devices, step, times = setup.cluster.num_devices, timing.step_s, timing.times
    if ddp is not None:  # the plan runs as DDP or FSDP: its own parts
        breakdown, hidden = dict(ddp.breakdown_s), dict(ddp.hidden_s)
    else:
        breakdown, hidden = _pipeline_breakdown(setup, priced, timing), {}
    return Estimate(
        step_time_s=step,
        per_stage_time_s=times,
        memory_per_device_bytes=int(max(stage.memory_bytes for stage in priced)),
        bubble_fraction=bubble_fraction([timing.m * t for t in times], pipeline_span_s=timing.phase_s),
        tflops_per_device=model_tflops_per_device(graph, step_time_s=step, num_devices=num_devices),
        mfu=mfu(graph, setup, step_time_s=step, num_devices=num_devices),
        breakdown_s=breakdown,
        hidden_s=hidden,
    )
