"""A one-stage data-parallel plan priced as the executor runs it: DDP, or FSDP at a ZeRO level.

A one-stage plan whose parameters are all replicated runs as DDP (:func:`planner.costing.stage_work.runs_as_ddp`)
and is priced as it runs (:func:`ddp_step`), ``T = m·(F + B) + R + A(g) + o``: ``F`` and ``B`` each node's
forward and backward work on plain tensors (no collectives; the recomputed forward runs first in ``B``),
``R`` the step's optimizer and bucket copies, ``A(g)`` what DDP's buckets leave exposed past the last backward
under gradient sync ``g`` (:mod:`planner.costing.overlap`, :mod:`planner.costing.compression`) instead of the
parameters' additive shares, and ``o`` the device's calibrated ``step_overhead_s``.

At a ZeRO level it runs FSDP, priced so too (:func:`fsdp_step`, :func:`planner.costing.zero.fsdp_price`):
``T = m·(C + g_f + g_b) + r + R' + o`` with ``C`` each node's compute on plain tensors, ``g_f`` and ``g_b`` the
gathers each microbatch waits for in its forward and backward, ``r`` the reduce-scatters the step waits for past
its last backward, and ``R'`` the optimizer on the shards and the copies.

The pure data-parallel plan is re-priced under each gradient sync offered (:func:`reprice_data_parallel`):
``T(g) = T(own) − T_DDP(own) + T_DDP(g)``, its memory changed by what ``g`` adds per device over its own sync;
the fastest that fits wins (:func:`planner.inter.grad_sync_choice.choose_grad_sync`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from planner.costing.compression import EXACT, refusal, stage_sync
from planner.costing.estimate import mfu, model_tflops_per_device
from planner.costing.overlap import after_backward_s
from planner.costing.setup import CostSetup
from planner.costing.stage_work import runs_as_ddp, stage_node_work
from planner.costing.zero import fsdp_price
from planner.inter.grad_sync_choice import choose_grad_sync, offered
from planner.inter.stage_pricing import PricedPipeline
from planner.ir.graph import OpGraph
from planner.plan import GradSync, Stage


@dataclass(frozen=True, kw_only=True)
class DdpStep:
    step_s: float
    exposed_sync_s: float  # DDP's bucketed all-reduce the backward pass does not hide (local SGD's average too)
    whole_sync_s: float  # all of it
    state_bytes: float = 0.0  # what the gradient sync adds per device (PowerSGD's error feedback)


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
    step = math.fsum(w.step_s - w.grad_sync_s for w in work.values())
    return DdpStep(step_s=m * (forward + backward) + step + waited + setup.cluster.device.step_overhead_s,
                   exposed_sync_s=waited, whole_sync_s=sync.comm_s, state_bytes=sync.state_bytes)  # fmt: skip


def fsdp_step(stage: Stage, graph: OpGraph, setup: CostSetup, *, m: int) -> DdpStep:
    """A data-parallel plan the executor runs under FSDP (ZeRO level ≥ 1), priced as it runs: each node's work on
    plain tensors, the gathers each microbatch waits for and the reduce-scatters the step waits for past its last
    backward (:func:`planner.costing.zero.fsdp_price`), the optimizer on the shards and the copies."""
    work = stage_node_work(stage, graph, setup, ddp=True)
    price = fsdp_price(stage, graph, setup, work=work, num_microbatches=m)
    compute = math.fsum(w.fwd_s + w.bwd_s + w.recompute_s for w in work.values())
    waits = m * (price.forward_wait_s + price.backward_wait_s) + price.tail_s
    step = math.fsum(w.step_s - w.zero_step_s for w in work.values())
    return DdpStep(step_s=m * compute + waits + step + setup.cluster.device.step_overhead_s, exposed_sync_s=waits,
                   whole_sync_s=price.comm_s)  # fmt: skip


def reprice_data_parallel(candidate: PricedPipeline, graph: OpGraph, setup: CostSetup, *, allow_lossy: bool,
                          forced: GradSync | None, zero: bool) -> PricedPipeline | None:  # fmt: skip
    """The pure data-parallel plan (one stage, one microbatch, ``graph`` the whole batch's) under the gradient
    syncs offered (:func:`planner.inter.grad_sync_choice.offered`): the candidate's step with its own sync's
    DDP price (:func:`ddp_step`) replaced by each choice's; None when none can run."""
    choices = offered(allow_lossy=allow_lossy, forced=forced)
    ddp = runs_as_ddp(candidate.stages, zero=zero)
    own = candidate.grad_sync
    base = ddp_step(candidate.stages[0], graph, setup, m=1, grad_sync=own) if ddp else None

    def price(grad_sync: GradSync) -> tuple[float, float] | None:
        if grad_sync == own:
            return candidate.estimate.step_time_s, 0.0
        if base is None or refusal(grad_sync, candidate.stages, zero=zero, cluster=setup.cluster, ddp=ddp):
            return None
        variant = ddp_step(candidate.stages[0], graph, setup, m=1, grad_sync=grad_sync)
        step_s = candidate.estimate.step_time_s - base.step_s + variant.step_s
        assert step_s > 0, f"internal error (please report): {grad_sync.label} priced at {step_s} s"
        return step_s, variant.state_bytes - base.state_bytes

    choice = choose_grad_sync(choices, price=price, memory_bytes=candidate.estimate.memory_per_device_bytes,
                              budget_bytes=setup.memory_budget_bytes)  # fmt: skip
    if choice is None or choice.grad_sync == own:
        return None if choice is None else candidate
    devices = setup.cluster.num_devices
    estimate = replace(candidate.estimate, step_time_s=choice.step_s,
                       memory_per_device_bytes=int(candidate.estimate.memory_per_device_bytes + choice.state_bytes),
                       tflops_per_device=model_tflops_per_device(graph, step_time_s=choice.step_s, num_devices=devices),
                       mfu=mfu(graph, setup, step_time_s=choice.step_s, num_devices=devices),
                       breakdown_s={**candidate.estimate.breakdown_s, "grad_sync_saved_s": choice.saved_s})  # fmt: skip
    notes = tuple(note for note in candidate.notes if not note.startswith("gradient sync "))
    return replace(candidate, estimate=estimate, grad_sync=choice.grad_sync,
                   notes=(*notes, choice.note()) if choice.grad_sync.lossy else notes)  # fmt: skip
