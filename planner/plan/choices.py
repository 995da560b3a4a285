"""Which of the planner's choices each stage uses, and what each saved against the next-best option.

One :class:`StageChoices` row per stage: its devices and mesh, the pipeline schedule (virtual stages per rank),
its recomputation, ZeRO level, Megatron sequence parallelism and the plan's gradient sync, and a
:class:`ChoiceSaving` per choice that has a next-best option (seconds per step and bytes per device, positive when
the choice is the cheaper):

* recomputation and ZeRO — ``Stage.memory_saving`` (:meth:`planner.inter.stage_shapes.StageTemplate.memory_saving`);
  a comparison with an identical alternative (ZeRO on a one-device stage, no saving either way) is left out;
* sequence parallelism — ``Stage.sequence_parallel_saving`` (:mod:`planner.inter.sp_saving`);
* the schedule, for the whole plan — ``estimate.savings.schedule_saved_s`` and ``.schedule_saved_bytes``
  against the GPipe or 1F1B pipeline the variant was cut from (:mod:`planner.inter.schedule_variants`);
* a lossy gradient sync, for the whole plan — ``estimate.savings.grad_sync_saved_s`` against exact sync
  (bytes not recorded). Exact sync is bucketed and overlapped with each stage's last backward.

:func:`plan_choices` reads them off a plan; ``plan --explain`` and ``plan show`` print them
(:mod:`planner.cli.choices_table`), ``plan show --json`` as :meth:`PlanChoices.to_json`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.plan.codec import JsonCoded
from planner.plan.parts import PlanView
from planner.plan.stage import Remat, Saving, Stage

EXACT_SYNC = "exact (bucketed, overlapped with the last backward)"
REMAT_WORDS = {Remat.NONE: "none", Remat.ATTENTION: "selective (attention)", Remat.FULL: "full"}


@dataclass(frozen=True, kw_only=True)
class ChoiceSaving(JsonCoded):
    """What ``choice`` (of ``kind``) saved against ``next_best``: seconds per step, bytes per device
    (None: not known)."""

    kind: str
    choice: str
    next_best: str
    saved_s: float
    saved_bytes: float | None

    @classmethod
    def from_stored(cls, kind: str, saving: Saving | None) -> ChoiceSaving | None:
        """A stage's stored saving, said as ``kind``; None when there is none."""
        if saving is None:
            return None
        return cls(
            kind=kind,
            choice=saving.choice,
            next_best=saving.next_best,
            saved_s=saving.saved_s,
            saved_bytes=saving.saved_bytes,
        )


@dataclass(frozen=True, kw_only=True)
class StageChoices(JsonCoded):
    stage: int
    devices: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    schedule: str
    recomputation: str
    zero: str
    sequence_parallel: bool
    grad_sync: str
    savings: tuple[ChoiceSaving, ...] = ()  # this stage's: recomputation and ZeRO, sequence parallelism


@dataclass(frozen=True, kw_only=True)
class PlanChoices(JsonCoded):
    stages: tuple[StageChoices, ...]
    plan_savings: tuple[ChoiceSaving, ...] = ()  # the whole plan's: schedule, lossy gradient sync


def memory_saving_of(stage: Stage) -> ChoiceSaving | None:
    """The stage's recomputation-and-ZeRO saving, or None: none stored, or a comparison with an identical
    alternative (no saving either way, or another ZeRO level on one device: a hand-edited plan's)."""
    saving = ChoiceSaving.from_stored("recomputation and ZeRO", stage.memory_saving)
    if saving is None:
        return None
    identical = math.isclose(saving.saved_s, 0.0, abs_tol=1e-12) and saving.saved_bytes == 0
    if identical or (len(stage.devices) == 1 and "ZeRO-" in saving.next_best):
        return None
    return saving


def schedule_label(plan: PlanView) -> str:
    """``interleaved, 2 virtual stages per rank``; ``1f1b``; ``none`` (one stage, one microbatch)."""
    ranks = len({stage.devices for stage in plan.stages})
    virtual = len(plan.stages) // max(ranks, 1)
    return f"{plan.schedule}, {virtual} virtual stages per rank" if virtual > 1 else plan.schedule


def _schedule_saving(plan: PlanView) -> ChoiceSaving | None:
    savings = plan.estimate.savings
    if savings.schedule_saved_s is None:
        return None
    ranks = len({stage.devices for stage in plan.stages})
    source = "gpipe" if plan.num_microbatches < ranks else "1f1b"  # what the variant's candidate was priced under
    return ChoiceSaving(
        kind="schedule",
        choice=schedule_label(plan),
        next_best=f"{source} on the same {ranks} device groups, one stage each",
        saved_s=savings.schedule_saved_s,
        saved_bytes=savings.schedule_saved_bytes,
    )


def _grad_sync_saving(plan: PlanView) -> ChoiceSaving | None:
    saved_s = plan.estimate.savings.grad_sync_saved_s
    if not plan.grad_sync.lossy or saved_s is None:
        return None
    return ChoiceSaving(
        kind="gradient sync",
        choice=plan.grad_sync.label,
        next_best="exact",
        saved_s=saved_s,
        saved_bytes=None,
    )


def _stage_row(plan: PlanView, stage: Stage) -> StageChoices:
    savings = (memory_saving_of(stage), ChoiceSaving.from_stored("sequence parallel", stage.sequence_parallel_saving))
    return StageChoices(
        stage=stage.index,
        devices=stage.devices,
        mesh_shape=stage.mesh_shape,
        schedule=schedule_label(plan),
        recomputation=REMAT_WORDS[stage.remat],
        zero=(f"ZeRO-{stage.zero}" + (", CPU offload" if stage.offload else "")) if stage.zero else "none",
        sequence_parallel=stage.uses_sequence_parallelism,
        grad_sync=plan.grad_sync.label if plan.grad_sync.lossy else EXACT_SYNC,
        savings=tuple(saving for saving in savings if saving is not None),
    )


def plan_choices(plan: PlanView) -> PlanChoices:
    """Each stage's choices and savings, and the whole plan's (see the module docstring)."""
    stages = tuple(_stage_row(plan, stage) for stage in sorted(plan.stages, key=lambda s: s.index))
    whole = (_schedule_saving(plan), _grad_sync_saving(plan))
    return PlanChoices(stages=stages, plan_savings=tuple(saving for saving in whole if saving is not None))
