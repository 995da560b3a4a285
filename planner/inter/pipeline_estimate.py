"""A priced candidate's estimate: its step in non-negative parts, its memory, bubble and model FLOPs.

The parts are those of ``T = Σ t_s + (m − 1)·P + U + w + o`` (:mod:`planner.inter.pricing`): one stage and one
microbatch as its operators' compute, collectives, resharding and recomputation; otherwise the steady state
``m·P`` and the fill and drain ``Σ t_s − P``; then ``U``, the tied weights' sync ``w`` and the host's ``o``. A plan run
as DDP or FSDP keeps its own parts (:class:`planner.costing.ddp.DdpStep`). The bubble is
:func:`cost_models.simulator.bubble_fraction` of the pipeline phase.
"""

from __future__ import annotations

import math

from cost_models.simulator import bubble_fraction
from planner.costing.ddp import DdpStep
from planner.costing.estimate import mfu, model_tflops_per_device
from planner.costing.setup import CostSetup
from planner.inter.stage_pricing import PricedStage
from planner.ir.graph import OpGraph
from planner.plan import Estimate, Stage


def _nonnegative(value: float, *, scale: float, what: str) -> float:
    """``value`` with float rounding below zero taken off; an internal error when it is truly negative."""
    assert value >= -1e-9 * max(scale, 1e-12), f"internal error (please report): {what} is {value!r} s"
    return max(0.0, value)


def _pipeline_breakdown(
    setup: CostSetup,
    priced: list[PricedStage],
    times: list[float],
    *,
    step: float,
    m: int,
    period: float,
    tied_s: float,
) -> dict[str, float]:
    """The parts of ``T = Σ t_s + (m − 1)·P + U + w + o`` (module docstring), each non-negative: one stage and one
    microbatch as its operators' compute, collectives, resharding and recomputation; otherwise the steady state
    ``m·P`` and the fill and drain ``Σ t_s − P``. ``U`` is what the step has past the pipeline phase."""
    overhead = setup.cluster.device.step_overhead_s
    phase = math.fsum(times) + (m - 1) * period
    after = _nonnegative(step - phase - tied_s - overhead, scale=step, what="the sync after the pipeline phase")
    if len(times) == 1 and m == 1:
        rows = priced[0].stage.explanation
        work = {
            "compute_s": math.fsum(r.compute_s for r in rows),
            "comm_s": math.fsum(r.comm_s for r in rows),
            "reshard_s": math.fsum(r.reshard_s for r in rows),
        }
        recompute = _nonnegative(times[0] - math.fsum(work.values()), scale=step, what="recomputation")
        parts = {**work, "recompute_s": recompute}
    else:
        fill = _nonnegative(math.fsum(times) - period, scale=step, what="the fill and drain")
        parts = {"steady_s": m * period, "fill_and_drain_s": fill}
    return {
        **parts,
        "grad_sync_and_optimizer_s": after,
        **({"tied_grad_sync_s": tied_s} if tied_s else {}),
        "host_overhead_s": overhead,
    }


def pipeline_estimate(
    graph: OpGraph,
    setup: CostSetup,
    priced: list[PricedStage],
    stages: tuple[Stage, ...],
    times: list[float],
    *,
    step: float,
    m: int,
    period: float,
    tied_s: float = 0.0,
    ddp: DdpStep | None = None,
) -> Estimate:
    """The candidate's estimate: ``step`` with its parts (:func:`_pipeline_breakdown`, or DDP's or FSDP's own when
    ``ddp`` holds how it runs), the stage times ``times``, the largest stage memory and the bubble."""
    num_devices = setup.cluster.num_devices
    if ddp is not None:  # the plan runs as DDP or FSDP: its own parts
        breakdown, hidden = dict(ddp.breakdown_s), dict(ddp.hidden_s)
    else:
        breakdown = _pipeline_breakdown(setup, priced, times, step=step, m=m, period=period, tied_s=tied_s)
        hidden = {}
    return Estimate(
        step_time_s=step,
        per_stage_time_s=tuple(times),
        memory_per_device_bytes=int(max(stage.memory_bytes for stage in priced)),
        bubble_fraction=bubble_fraction([m * t for t in times], pipeline_span_s=math.fsum(times) + (m - 1) * period),
        tflops_per_device=model_tflops_per_device(graph, step_time_s=step, num_devices=num_devices),
        mfu=mfu(graph, setup, step_time_s=step, num_devices=num_devices),
        breakdown_s=breakdown,
        hidden_s=hidden,
    )
