"""One-stage data-parallel plans priced as the executor runs them: DDP, or FSDP at a ZeRO level.

A one-stage plan whose parameters are all replicated runs as DDP (:func:`planner.costing.stage_work.runs_as_ddp`)
and is priced as it runs (:func:`ddp_step`), ``T = m·(F + B) + R + A(g) + o``: ``F`` and ``B`` each node's
forward and backward work on plain tensors (no collectives; the recomputed forward runs first in ``B``),
``R`` the step's optimizer and bucket copies (under a parameter server the busiest server's share of them,
:attr:`planner.costing.compression.StageSync.optimizer_share`), ``A(g)`` what DDP's buckets leave exposed past the
last backward under gradient sync ``g`` (:mod:`planner.costing.overlap`, :mod:`planner.costing.compression`)
instead of the parameters' additive shares, and ``o`` the device's calibrated ``step_overhead_s``.

At a ZeRO level it runs FSDP, priced so too (:func:`fsdp_step`, :func:`planner.costing.zero.fsdp_price`):
``T = m·(C + g_f + g_b) + r + R' + o`` with ``C`` each node's compute on plain tensors, ``g_f`` and ``g_b`` the
gathers each microbatch waits for in its forward and backward, ``r`` the reduce-scatters the step waits for past
its last backward, and ``R'`` the optimizer on the shards and the copies (on the CPU under offload,
``host_optimizer_s``: :mod:`planner.costing.offload`).

Each step carries its parts (``breakdown_s``, adding up to it) and the sync the backward hides (``hidden_s``);
:func:`ddp_estimate` makes them a plan's estimate. No solver is imported here: a one-device estimate needs none.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from planner.costing.compression import EXACT, stage_sync
from planner.costing.estimate import mfu, model_tflops_per_device
from planner.costing.offload import offloaded_casts_s, optimizer_step_s
from planner.costing.overlap import after_backward_s
from planner.costing.setup import CostSetup
from planner.costing.stage_work import stage_node_work
from planner.costing.zero import fsdp_price
from planner.ir.graph import OpGraph
from planner.plan import Estimate, GradSync, PlanSavings, Stage


@dataclass(frozen=True, kw_only=True)
class DdpStep:
    """A one-stage data-parallel step as DDP or FSDP runs it: ``step_s`` and its parts (``breakdown_s``, adding up
    to it), the sync the backward pass hides (``hidden_s``) and what the sync adds per device."""

    step_s: float
    exposed_sync_s: float  # DDP's bucketed all-reduce the backward pass does not hide (local SGD's average too)
    whole_sync_s: float  # all of it
    breakdown_s: Mapping[str, float]
    hidden_s: Mapping[str, float]
    state_bytes: float = 0.0  # what the gradient sync adds per device (PowerSGD's error feedback)


def _parts(**parts: float) -> tuple[float, dict[str, float]]:
    """The step as the exact sum of its parts (one rounding), and the parts."""
    return math.fsum(parts.values()), dict(parts)


def ddp_step(stage: Stage, graph: OpGraph, setup: CostSetup, *, m: int, grad_sync: GradSync = EXACT) -> DdpStep:
    """A one-stage plan the executor runs as DDP, priced as it runs: each node's work on plain tensors
    (no collectives), the step's optimizer and bucket copies, and DDP's buckets overlapped with the last
    backward (recomputation first) instead of the parameters' additive shares (:mod:`planner.costing.overlap`),
    priced under ``grad_sync`` (:mod:`planner.costing.compression`)."""
    work = stage_node_work(stage, graph, setup, ddp=True)
    forward = math.fsum(w.fwd_s for w in work.values())
    backward = math.fsum(w.bwd_s + w.recompute_s for w in work.values())  # the recomputed forward first
    sync = stage_sync(stage, graph, {name: w.bwd_s for name, w in work.items()}, setup, grad_sync=grad_sync, ddp=True)
    waited = after_backward_s(sync.segments, backward_s=backward) + sync.amortised_s
    recompute = m * math.fsum(w.recompute_s for w in work.values())
    step, parts = _parts(
        compute_s=m * (forward + backward) - recompute,
        recompute_s=recompute,
        grad_sync_s=waited,
        optimizer_and_bucket_copies_s=sync.optimizer_share * math.fsum(w.step_s - w.grad_sync_s for w in work.values()),
        host_overhead_s=setup.cluster.device.step_overhead_s,
    )
    hidden = {"grad_sync_overlapped_s": max(0.0, sync.comm_s - waited) + sync.hidden_s}
    return DdpStep(
        step_s=step,
        exposed_sync_s=waited,
        whole_sync_s=sync.comm_s,
        breakdown_s=parts,
        hidden_s=hidden,
        state_bytes=sync.state_bytes,
    )


def fsdp_step(stage: Stage, graph: OpGraph, setup: CostSetup, *, m: int) -> DdpStep:
    """A data-parallel plan the executor runs under FSDP (ZeRO level ≥ 1), priced as it runs: each node's work on
    plain tensors, the gathers each microbatch waits for and the reduce-scatters the step waits for past its last
    backward (:func:`planner.costing.zero.fsdp_price`), the optimizer on the shards and the copies."""
    work = stage_node_work(stage, graph, setup, ddp=True)
    price = fsdp_price(stage, graph, setup, work=work, num_microbatches=m)
    waits = m * (price.forward_wait_s + price.backward_wait_s) + price.tail_s
    step, parts = _parts(
        compute_s=m * math.fsum(w.fwd_s + w.bwd_s for w in work.values()),
        recompute_s=m * math.fsum(w.recompute_s for w in work.values()),
        zero_sync_s=waits,
        **{("host_optimizer_s" if stage.offload else "optimizer_s"): optimizer_step_s(stage, graph, setup, work=work)},
        weight_casts_s=offloaded_casts_s(stage, graph, setup),  # in optimizer_s's node steps when not offloaded
        host_overhead_s=setup.cluster.device.step_overhead_s,
    )
    hidden = {"zero_sync_overlapped_s": max(0.0, price.comm_s - waits)}
    return DdpStep(step_s=step, exposed_sync_s=waits, whole_sync_s=price.comm_s, breakdown_s=parts, hidden_s=hidden)


def ddp_estimate(
    graph: OpGraph, setup: CostSetup, step: DdpStep, *, memory_bytes: float, savings: PlanSavings | None = None
) -> Estimate:
    """The estimate of a one-stage data-parallel plan priced by :func:`ddp_step` or :func:`fsdp_step`
    (``graph``: the whole batch's, for the model FLOPs), holding ``memory_bytes`` per device."""
    devices = setup.cluster.num_devices
    return Estimate(
        step_time_s=step.step_s,
        per_stage_time_s=(step.step_s,),
        memory_per_device_bytes=int(memory_bytes),
        bubble_fraction=0.0,
        tflops_per_device=model_tflops_per_device(graph, step_time_s=step.step_s, num_devices=devices),
        mfu=mfu(graph, setup, step_time_s=step.step_s, num_devices=devices),
        breakdown_s=step.breakdown_s,
        hidden_s=step.hidden_s,
        savings=savings or PlanSavings(),
    )
