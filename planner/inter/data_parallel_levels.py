"""A one-stage data-parallel candidate at each ZeRO level, priced exactly as it runs, and the fastest that fits.

The layer tables rank ZeRO levels by the stage problem's additive costs, as a sharded stage pays them (the
gradient all-reduce, then the gather of the updated parameters). A one-stage plan whose parameters are all
replicated does not run so: at level 0 it runs DDP (:func:`planner.costing.ddp.ddp_step`: bucket
copies, the full optimizer step, buckets overlapped with the backward) and at a level ``z ≥ 1`` FSDP
(:func:`planner.costing.ddp.fsdp_step`: reduce-scatters instead of the all-reduce, the optimizer
on ``1/d`` of the state). :func:`best_level` prices the candidate's stage at every level the options allow by
those functions and keeps the fastest that fits; its memory at each level is what that runtime holds
(``memory_at``: DDP's replica and buckets, :func:`planner.costing.plan_memory.sharded_stage_memory`, or FSDP's
shards, gathers and reduce-scatters, :func:`planner.costing.zero.fsdp_memory`). The stage's recomputation-and-ZeRO line
(``Stage.memory_saving``) is then that exact comparison: the kept level against the fastest other level that
fits (else the fastest other), at the same recomputation.

CPU offload (``Stage.offload``, :mod:`planner.costing.offload`) is one more memory choice on such a stage at a level
``z ≥ 1``: :func:`best_offloaded_level` keeps the fastest level that fits with it, and its line compares it with
the fastest choice without it (the planner offloads only when none of those fits: offload never saves time).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from planner.costing.setup import CostSetup
from planner.ir.graph import OpGraph
from planner.plan import ZERO_LEVELS, Stage
from planner.plan.stage import MemorySaving, memory_choice_label


@dataclass(frozen=True, kw_only=True)
class LevelPrice:
    level: int
    step_s: float
    memory_bytes: float
    offload: bool = False


def allowed_levels(zero: str | int) -> tuple[int, ...]:
    return tuple(ZERO_LEVELS) if str(zero) == "auto" else (int(zero),)


def best_level(
    stage: Stage,
    graph: OpGraph,
    setup: CostSetup,
    *,
    zero: str | int,
    step_at: Callable[[int], float],
    memory_at: Callable[[int], float],
) -> tuple[LevelPrice, MemorySaving | None]:
    """The fastest level (``step_at(level)``: the exact step there; ``memory_at(level)``: what a device holds
    there) whose memory fits, else the smallest; and the stage's line comparing it with the next best level
    (module docstring); of equally fast levels the one holding less."""
    prices = [
        LevelPrice(level=level, step_s=step_at(level), memory_bytes=memory_at(level)) for level in allowed_levels(zero)
    ]
    budget = setup.memory_budget_bytes
    chosen = min(prices, key=lambda price: (price.memory_bytes > budget, price.step_s, price.memory_bytes))
    others = [price for price in prices if price.level != chosen.level]
    if not others:
        return chosen, None
    other = min(others, key=lambda price: (price.memory_bytes > budget, price.step_s))
    return chosen, _line(stage, chosen, other, budget_bytes=budget)


def _line(stage: Stage, chosen: LevelPrice, other: LevelPrice, *, budget_bytes: float) -> MemorySaving:
    """The stage's line: ``chosen`` against ``other`` at the stage's recomputation."""
    return MemorySaving(
        choice=memory_choice_label(stage.remat, chosen.level, offload=chosen.offload),
        next_best=memory_choice_label(stage.remat, other.level, offload=other.offload)
        + (" (does not fit)" if other.memory_bytes > budget_bytes else ""),
        saved_s=other.step_s - chosen.step_s,
        saved_bytes=other.memory_bytes - chosen.memory_bytes,
        next_best_remat=stage.remat,
        next_best_zero=other.level,
    )


def best_offloaded_level(
    stage: Stage,
    setup: CostSetup,
    *,
    zero: str | int,
    step_at: Callable[[int, bool], float],
    memory_at: Callable[[int, bool], float],
    only_if_needed: bool,
) -> tuple[LevelPrice, MemorySaving] | None:
    """The fastest FSDP level (of ``zero``'s, 0 left out) that fits with CPU offload (``step_at(level, offload)``,
    ``memory_at(level, offload)``: as :func:`best_level`'s), and its line against the fastest level without it;
    None when no level fits even with it, or (``only_if_needed``) when a level fits without it."""
    levels = [level for level in allowed_levels(zero) if level]
    budget = setup.memory_budget_bytes

    def priced(level: int, offload: bool) -> LevelPrice:
        return LevelPrice(
            level=level, step_s=step_at(level, offload), memory_bytes=memory_at(level, offload), offload=offload
        )

    without = [priced(level, False) for level in allowed_levels(zero)]
    other = min(without, key=lambda price: (price.memory_bytes > budget, price.step_s))
    if only_if_needed and other.memory_bytes <= budget:
        return None
    fitting = [price for price in (priced(level, True) for level in levels) if price.memory_bytes <= budget]
    if not fitting:
        return None
    chosen = min(fitting, key=lambda price: (price.step_s, price.memory_bytes))
    return chosen, _line(stage, chosen, other, budget_bytes=budget)
