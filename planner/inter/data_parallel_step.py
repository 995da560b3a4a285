"""The pure data-parallel plan under each gradient sync the options offer (:func:`reprice_data_parallel`).

Each choice is priced as DDP runs it (:func:`planner.costing.ddp.ddp_step` under that sync) and the fastest that
fits wins (:func:`planner.inter.grad_sync_choice.choose_grad_sync`); its memory changes by what the sync adds per
device over the plan's own.
"""

from __future__ import annotations

from dataclasses import replace

from planner.costing.compression import refusal
from planner.costing.ddp import DdpStep, ddp_estimate, ddp_step
from planner.costing.setup import CostSetup
from planner.costing.stage_work import runs_as_ddp
from planner.inter.grad_sync_choice import choose_grad_sync, offered
from planner.inter.stage_pricing import PricedPipeline
from planner.ir.graph import OpGraph
from planner.plan import GradSync


def reprice_data_parallel(
    candidate: PricedPipeline,
    graph: OpGraph,
    setup: CostSetup,
    *,
    allow_lossy: bool,
    forced: GradSync | None,
    zero: bool,
) -> PricedPipeline | None:
    """The pure data-parallel plan (one stage, one microbatch, ``graph`` the whole batch's, priced by
    :func:`ddp_step`) under the gradient syncs offered (:func:`planner.inter.grad_sync_choice.offered`): each
    choice priced by :func:`ddp_step` under it; the fastest that fits; None when none can run."""
    choices = offered(allow_lossy=allow_lossy, forced=forced)
    ddp = runs_as_ddp(candidate.stages)
    own = candidate.grad_sync
    own_state = ddp_step(candidate.stages[0], graph, setup, m=1, grad_sync=own).state_bytes if ddp else 0.0
    priced: dict[GradSync, DdpStep] = {}

    def price(grad_sync: GradSync) -> tuple[float, float] | None:
        if grad_sync == own:
            return candidate.estimate.step_time_s, 0.0
        if not ddp or refusal(
            grad_sync, candidate.stages, zero=zero, cluster=setup.cluster, ddp=ddp, optimizer=setup.optimizer
        ):
            return None
        priced[grad_sync] = variant = ddp_step(candidate.stages[0], graph, setup, m=1, grad_sync=grad_sync)
        assert variant.step_s > 0, f"internal error (please report): {grad_sync.label} priced at {variant.step_s} s"
        return variant.step_s, variant.state_bytes - own_state

    choice = choose_grad_sync(
        choices,
        price=price,
        memory_bytes=candidate.estimate.memory_per_device_bytes,
        budget_bytes=setup.memory_budget_bytes,
    )
    if choice is None or choice.grad_sync == own:
        return None if choice is None else candidate
    estimate = ddp_estimate(
        graph,
        setup,
        priced[choice.grad_sync],
        memory_bytes=candidate.estimate.memory_per_device_bytes + choice.state_bytes,
        savings=replace(candidate.estimate.savings, grad_sync_saved_s=choice.saved_s),
    )
    notes = tuple(note for note in candidate.notes if not note.startswith("gradient sync "))
    return replace(
        candidate,
        estimate=estimate,
        grad_sync=choice.grad_sync,
        notes=(*notes, choice.note(setup)) if choice.grad_sync.lossy else notes,
    )
