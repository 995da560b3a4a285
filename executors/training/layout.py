"""The ``parallelize`` section of a compiled ``train.py``: the plan's parallel structure as values the program passes.

``plan compile`` writes the section from the plan (:mod:`executors.training.layout_text`); the program calls
:func:`mesh`, :func:`stage` and :func:`schedule` there, and :func:`resolve_layout` turns what it passed into the
plan the runtime runs:

* **honoured** — the schedule's name and its number of microbatches: the plan runs with them, once they pass the
  checks the plan's own did (a batch that splits evenly, 1F1B with at least as many microbatches as stages, the
  rounds of torch's interleaved schedules: :func:`planner.plan.schedules.check_schedule`);
* **checked** — every stage's module range, mesh (ranks, axis names and sizes), parameter placements, ZeRO level
  and recomputation, the virtual stages per rank and the gradient sync: these are what the plan was searched and
  priced for, so an edit is refused in one line naming the line of ``train.py`` to change back (re-plan instead).

Placements are DTensor placements (``Shard(d)``, ``Replicate()``, ``Partial()``), one per mesh axis, keyed by a
parameter name or a pattern (``*`` matches any run of characters, as :func:`fnmatch.fnmatchcase`); a parameter takes
the entry of its exact name, else of the first other pattern that matches it, else ``"*"`` (:func:`placement_of`).
The plan's ``R*`` (replicated, gradient as partial sums) is written ``Replicate()``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from pathlib import Path

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from planner.errors import AutoplanError
from planner.plan import GATHERED, Plan, Stage
from planner.plan.schedules import MULTI_STAGE_SCHEDULES, Schedule, check_schedule
from planner.plan.stage import axis_roles, stage_degrees


class LayoutEdit(AutoplanError):
    """An edit of the ``parallelize`` section the runtime cannot run."""


@dataclass(frozen=True, kw_only=True)
class SourceLine:
    """Where in the program a value was written (``train.py line 57``)."""

    file: str
    line: int

    def text(self) -> str:
        return f"{Path(self.file).name} line {self.line}"


def _caller_line(depth: int = 2) -> SourceLine:
    frame = sys._getframe(depth)
    return SourceLine(file=frame.f_code.co_filename, line=frame.f_lineno)


@dataclass(frozen=True, kw_only=True)
class MeshSpec:
    ranks: tuple[int, ...]
    axes: tuple[tuple[str, int], ...]  # (name, size) per mesh axis, in order


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    index: int
    modules: tuple[str, str] | None
    mesh: MeshSpec
    placements: Mapping[str, tuple[str, ...]]  # pattern -> spec strings ("S(0)", "R", "P"), one per mesh axis
    zero: int
    recompute: str
    where: SourceLine


@dataclass(frozen=True, kw_only=True)
class GradSyncSpec:
    kind: str  # the plan's label: exact, bf16, powersgd:R, local-sgd:H
    where: SourceLine


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    name: str
    microbatches: int
    virtual_stages: int
    where: SourceLine = field(compare=False)


def mesh(ranks: Sequence[int], **axes: int) -> MeshSpec:
    """A stage's device mesh: its ranks (row-major over the axes) and each axis's name and size, e.g.
    ``mesh([0, 1, 2, 3], dp=2, tp=2)``."""
    return MeshSpec(
        ranks=tuple(int(rank) for rank in ranks), axes=tuple((name, int(size)) for name, size in axes.items())
    )


def stage(
    index: int,
    *,
    modules: tuple[str, str] | None,
    mesh: MeshSpec,
    placements: Mapping[str, Sequence[Placement]],
    zero: int = 0,
    recompute: str = "none",
) -> StageSpec:
    """One pipeline stage: the modules it runs (first, last), its mesh, its parameters' placements, its ZeRO level
    and recomputation (all checked against the plan: :func:`resolve_layout`)."""
    specs = {pattern: tuple(_spec(p) for p in placement) for pattern, placement in placements.items()}
    return StageSpec(
        index=index,
        modules=tuple(modules) if modules is not None else None,  # type: ignore[arg-type]
        mesh=mesh,
        placements=specs,
        zero=zero,
        recompute=str(recompute),
        where=_caller_line(),
    )


def schedule(name: str, *, microbatches: int, virtual_stages: int = 1) -> ScheduleSpec:
    """The pipeline schedule and the microbatches per step (honoured when edited: :func:`resolve_layout`)."""
    return ScheduleSpec(
        name=str(name), microbatches=int(microbatches), virtual_stages=virtual_stages, where=_caller_line()
    )


def gradient_sync(kind: str) -> GradSyncSpec:
    """How gradients are synchronised (``exact``, ``bf16``, ``powersgd:R``, ``local-sgd:H``; checked)."""
    return GradSyncSpec(kind=str(kind), where=_caller_line())


def _spec(placement: Placement) -> str:
    if isinstance(placement, Shard):
        return f"S({placement.dim})"
    if isinstance(placement, Partial):
        return "P"
    if isinstance(placement, Replicate):
        return "R"
    raise LayoutEdit(f"placement {placement!r} is not Shard(d), Replicate() or Partial()")


def module_range(stage: Stage) -> tuple[str, str] | None:
    """The modules holding the stage's first and last parameters (None: a stage without parameters)."""
    names = list(stage.param_placements)
    if not names:
        return None
    return (_module_of(names[0]), _module_of(names[-1]))


def _module_of(param: str) -> str:
    return param.rpartition(".")[0] or param


def axis_names(stage: Stage) -> tuple[str, ...]:
    """``dp`` for a data-parallel mesh axis, ``tp`` for a tensor-parallel one (:func:`planner.plan.shape.axis_roles`);
    numbered (``dp0``, ``dp1``) when two axes share a role."""
    short = ["tp" if role == "tensor" else "dp" for role in axis_roles(stage)]
    return tuple(f"{name}{short[:i].count(name)}" if short.count(name) > 1 else name for i, name in enumerate(short))


def plan_spec(placement: Sequence[str]) -> tuple[str, ...]:
    """A plan placement as the section writes it (``R*`` is written ``Replicate()``)."""
    return tuple("R" if part == GATHERED else part for part in placement)


def placement_of(name: str, placements: Mapping[str, tuple[str, ...]]) -> tuple[str | None, tuple[str, ...] | None]:
    """The entry a parameter takes (see the module docstring): (its key, its spec), or (None, None)."""
    if name in placements:
        return name, placements[name]
    for pattern, spec in placements.items():
        if pattern != "*" and fnmatchcase(name, pattern):
            return pattern, spec
    if "*" in placements:
        return "*", placements["*"]
    return None, None


def resolve_layout(plan: Plan, *, stages: Sequence[StageSpec], schedule: ScheduleSpec, grad_sync: GradSyncSpec) -> Plan:
    """The plan to run: ``plan`` with the section's schedule and microbatches; :class:`LayoutEdit` naming the line
    of an edit the runtime cannot honour (see the module docstring)."""
    if grad_sync.kind != plan.grad_sync.label:
        raise LayoutEdit(
            f"{grad_sync.where.text()}: gradient sync {grad_sync.kind!r} is not the plan's {plan.grad_sync.label!r}: "
            "change it back (a gradient sync is chosen when planning: `plan ... --allow-lossy`)"
        )
    planned = sorted(plan.stages, key=lambda s: s.index)
    if len(stages) != len(planned):
        raise LayoutEdit(
            f"{schedule.where.text()}: the section lists {len(stages)} stages, the plan has {len(planned)}: change it "
            "back (the stages are the plan's: re-plan to change them)"
        )
    for written, stage_of_plan in zip(stages, planned, strict=True):
        _check_stage(written, stage_of_plan)
    return _with_schedule(plan, schedule)


def _refuse(where: SourceLine, what: str, written: object, planned: object) -> LayoutEdit:
    return LayoutEdit(
        f"{where.text()}: {what} is {written} but the plan's is {planned}: change it back (the runtime runs the "
        "plan's stages, meshes and placements; re-plan to change them)"
    )


def _check_stage(written: StageSpec, planned: Stage) -> None:
    where, label = written.where, f"stage {planned.index}"
    if written.index != planned.index:
        raise _refuse(where, f"{label}'s index", written.index, planned.index)
    if written.modules != module_range(planned):
        raise _refuse(where, f"{label}'s module range", written.modules, module_range(planned))
    if written.mesh.ranks != tuple(planned.devices):
        raise _refuse(where, f"{label}'s mesh ranks", list(written.mesh.ranks), list(planned.devices))
    axes = tuple(zip(axis_names(planned), planned.mesh_shape, strict=True))
    if written.mesh.axes != axes:
        raise _refuse(where, f"{label}'s mesh axes", dict(written.mesh.axes), dict(axes))
    if written.zero != planned.zero:
        raise _refuse(where, f"{label}'s ZeRO level", written.zero, planned.zero)
    if written.recompute != str(planned.remat):
        raise _refuse(where, f"{label}'s recompute", repr(written.recompute), repr(str(planned.remat)))
    used: set[str] = set()
    for name, placement in planned.param_placements.items():
        key, spec = placement_of(name, written.placements)
        if spec != plan_spec(placement):
            line = _line_of(key, where) if key is not None else where
            raise _refuse(
                line, f"the placement of {name}", spec_text(spec) if spec else "missing", spec_text(placement)
            )
        used.add(str(key))
    unused = [pattern for pattern in written.placements if pattern not in used]
    if unused:
        raise LayoutEdit(
            f"{_line_of(unused[0], where).text()}: placements entry {unused[0]!r} matches no parameter of {label}: "
            "remove it"
        )


def spec_text(spec: Sequence[str]) -> str:
    """``("S(0)", "R")`` -> ``[Shard(0), Replicate()]``."""
    words = {"R": "Replicate()", "P": "Partial()", GATHERED: "Replicate()"}
    return "[" + ", ".join(words.get(part, f"Shard({part[2:-1]})") for part in spec) + "]"


def _line_of(key: str, stage_line: SourceLine) -> SourceLine:
    """The line of the placements entry ``key`` (the first line quoting it from the stage's call on)."""
    try:
        lines = Path(stage_line.file).read_text().splitlines()
    except OSError:
        return stage_line
    for number in range(stage_line.line, len(lines) + 1):
        if f'"{key}"' in lines[number - 1] or f"'{key}'" in lines[number - 1]:
            return replace(stage_line, line=number)
    return stage_line


def _with_schedule(plan: Plan, written: ScheduleSpec) -> Plan:
    where = written.where.text()
    if written.virtual_stages != plan.virtual_stages:
        raise LayoutEdit(
            f"{where}: virtual_stages={written.virtual_stages} but the plan has {plan.virtual_stages} per rank: "
            "change it back (re-plan with another --virtual-stages)"
        )
    if written.name == plan.schedule and written.microbatches == plan.num_microbatches:
        return plan
    names = [Schedule.NONE] if len(plan.stages) == 1 else [s for s in Schedule if s not in ("none", "dataflow")]
    if plan.schedule == Schedule.DATAFLOW:
        names = [Schedule.DATAFLOW]
    if written.name not in names:
        raise LayoutEdit(f"{where}: schedule {written.name!r} cannot run this plan: use {' or '.join(names)}")
    m = written.microbatches
    try:
        _check_microbatches(plan, name=Schedule(written.name), microbatches=m)
    except AutoplanError as error:
        raise LayoutEdit(f"{where}: {error}") from None
    return replace(plan, schedule=Schedule(written.name), num_microbatches=m)


def _check_microbatches(plan: Plan, *, name: Schedule, microbatches: int) -> None:
    """The checks the plan's own microbatches passed: each microbatch splits over every stage's data axes."""
    replicas = max(stage_degrees(stage).data for stage in plan.stages)
    if microbatches < 1 or plan.batch_size % (microbatches * replicas):
        shares = f" of {replicas} data-parallel shares each" if replicas > 1 else ""
        raise AutoplanError(f"the batch of {plan.batch_size} does not split into {microbatches} microbatches{shares}")
    if name == Schedule.ONE_F_ONE_B and microbatches < len(plan.stages):
        raise AutoplanError(f"1f1b needs at least as many microbatches as stages ({len(plan.stages)}): or use gpipe")
    if name in MULTI_STAGE_SCHEDULES or plan.virtual_stages > 1:
        check_schedule(
            name, num_ranks=plan.num_pipeline_ranks, virtual_stages=plan.virtual_stages, num_microbatches=microbatches
        )
