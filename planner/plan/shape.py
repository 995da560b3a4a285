"""A plan's shape in the words engineers use: ``pipeline 2 × tensor 4 × data 8, 16 microbatches, 1F1B, recompute on``.

The degrees come from the plan itself: the pipeline degree is the number of stages; inside a
stage, each mesh axis is *tensor* (model) parallel or *data* parallel (:func:`planner.plan.stage.axis_roles`). An
axis along which every parameter is replicated is data parallel. An axis that shards parameters
is tensor parallel, unless more parameters have their gradients all-reduced over it (the
strategies' ``sync`` collectives: replicas that saw different shares of the batch) than are
sharded along it: an axis that splits the batch and shards only, say, the embeddings is data
parallel (the stage line of the summary counts the sharded parameters). Degrees of 1 are left out. Operator placements
(schedule ``dataflow``) have no degrees: they put each operator on one device and let
microbatches flow.
"""

from __future__ import annotations

from planner.plan.parts import PlanView
from planner.plan.schedules import Schedule
from planner.plan.stage import Stage, stage_degrees

SCHEDULE_NAMES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "interleaved 1F1B", "zero-bubble": "zero bubble"}


def count_of(number: int, singular: str, plural: str | None = None) -> str:
    """``1 microbatch``, ``4 microbatches``."""
    return f"{number} {singular if number == 1 else plural or singular + 's'}"


def plan_shape(plan: PlanView) -> str:
    """One line: the degrees, microbatches, schedule, recomputation and ZeRO of ``plan``."""
    if plan.schedule == Schedule.DATAFLOW:
        return _placement_shape(plan)
    stages = sorted(plan.stages, key=lambda stage: stage.index)
    parts = [_degrees_text(stages)]
    if plan.num_microbatches > 1:
        parts.append(count_of(plan.num_microbatches, "microbatch", "microbatches"))
    if len(stages) > 1:
        name = SCHEDULE_NAMES.get(plan.schedule, plan.schedule)
        virtual = plan.virtual_stages
        parts.append(name + (f" ({virtual} virtual stages per rank)" if virtual > 1 else ""))
    parts.append(_recompute_text(stages))
    if plan.zero:
        parts.append(_zero_text(stages))
    return ", ".join(parts)


def _degrees_text(stages: list[Stage]) -> str:
    degrees = [stage_degrees(stage) for stage in stages]
    if len(stages) == 1:
        return degrees[0].text()
    if len(set(degrees)) == 1:
        inner = degrees[0].text()
        ranks = len({stage.devices for stage in stages})  # fewer than the stages when a rank holds several
        return f"pipeline {ranks}" + ("" if inner == "1 device" else f" × {inner}")
    homes = list(dict.fromkeys(stage.devices for stage in stages))  # a rank holds several stages when interleaved
    return f"pipeline {len(homes)} stages on {'+'.join(str(len(devices)) for devices in homes)} devices"


_RECOMPUTE_NAMES = {"attention": "selective (attention)", "full": "full"}
_ZERO_NAMES = {1: "optimizer state", 2: "optimizer state and gradients", 3: "optimizer state, gradients and parameters"}


def _recompute_text(stages: list[Stage]) -> str:
    kinds = [str(stage.remat) for stage in stages if stage.remat]
    if not kinds:
        return "recompute off"
    if len(kinds) == len(stages) and len(set(kinds)) == 1:
        return f"recompute {_RECOMPUTE_NAMES[kinds[0]]}"
    counts = ", ".join(f"{_RECOMPUTE_NAMES[kind]} in {kinds.count(kind)}" for kind in dict.fromkeys(kinds))
    return f"recompute {counts} of {len(stages)} stages"


def _zero_text(stages: list[Stage]) -> str:
    levels = [stage.zero for stage in stages if stage.zero]
    if len(levels) == len(stages) and len(set(levels)) == 1:
        offload = "; their shards in host memory, the optimizer on the CPU" if all(s.offload for s in stages) else ""
        return f"ZeRO-{levels[0]} ({_ZERO_NAMES[levels[0]]} sharded over the data axes{offload})"
    return (
        "ZeRO "
        + ", ".join(f"{level} in {levels.count(level)}" for level in sorted(set(levels)))
        + (f" of {len(stages)} stages")
    )


def _placement_shape(plan: PlanView) -> str:
    used = len({device for stage in plan.stages for device in stage.devices})
    total = plan.cluster.num_devices
    over = count_of(used, "device") if used == total else f"{used} of {count_of(total, 'device')}"
    flowing = count_of(plan.num_microbatches, "microbatch", "microbatches")
    return f"operator placement over {over} ({plan.method}), {flowing} flowing"
