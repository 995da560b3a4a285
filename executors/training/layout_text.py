"""The text of the ``parallelize`` section ``plan compile`` writes into ``train.py`` (:func:`parallelize_section`).

One ``runtime.stage(...)`` call per stage names its module range, its mesh (ranks, axis names and sizes), its
parameters' DTensor placements, ZeRO level and recomputation; then the schedule and the gradient sync. Placements
are grouped so that a 48-layer model stays a page (:func:`placement_entries`): ``"*"`` takes the stage's most
common placement, a pattern (the parameter name with its layer numbers as ``*``, or its module's, ``blocks.*.ln_1.*``,
when all the module's parameters are placed alike) each group of layers placed alike otherwise, and an exact name
only a parameter its group disagrees on. The section is a summary: every detail
stays in plan.json; :mod:`executors.training.layout` checks the section against it when the program runs.
"""

from __future__ import annotations

import re
from collections import Counter

from executors.training.layout import axis_names, module_range, placement_of, plan_spec, spec_text
from planner.plan import Plan, Stage
from planner.plan.schedules import MULTI_STAGE_SCHEDULES, Schedule
from planner.plan.shape import SCHEDULE_NAMES

_LAYER_NUMBER = re.compile(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)")

SECTION_DOC = '''    """The plan's parallel structure in plain code (written from plan.json by `plan compile`).

    The runtime builds this rank's part of the model from the values passed here. It honours an edit of the
    schedule's name or its microbatches; the stages (module ranges), meshes, placements, ZeRO levels,
    recomputation and gradient sync are the plan's, so an edit of those stops the program with one line naming
    the line to change back: re-plan to change them. Placements are DTensor's, one per mesh axis, by parameter
    name or pattern ("*" matches any characters; an exact name wins over a pattern, a pattern over "*").
    """'''


def placement_entries(stage: Stage) -> dict[str, tuple[str, ...]]:
    """Pattern or name -> placement, as the section writes them (see the module docstring); every parameter of
    the stage resolves to its plan placement (:func:`executors.training.layout.placement_of`)."""
    specs = {name: plan_spec(placement) for name, placement in stage.param_placements.items()}
    if not specs:
        return {}
    default = Counter(specs.values()).most_common(1)[0][0]
    groups: dict[str, list[str]] = {}
    for name in specs:
        groups.setdefault(_LAYER_NUMBER.sub("*", name), []).append(name)
    entries: dict[str, tuple[str, ...]] = {"*": default}
    for pattern, names in _by_module(groups, specs).items():
        kinds = {specs[name] for name in names}
        if len(kinds) == 1 and kinds != {default}:
            entries[pattern] = kinds.pop()
        elif len(kinds) > 1:
            entries.update({name: specs[name] for name in names if specs[name] != default})
    for name, spec in specs.items():  # a pattern that also matched another group's name: that name exactly
        if placement_of(name, entries)[1] != spec:
            entries = {name: spec, **entries}
    return entries


def _by_module(groups: dict[str, list[str]], specs: dict[str, tuple[str, ...]]) -> dict[str, list[str]]:
    """Parameter patterns merged into their module's (``blocks.*.ln_1.*``) where the module's are all placed alike."""
    modules: dict[str, list[str]] = {}
    for pattern in groups:
        modules.setdefault(pattern.rpartition(".")[0] + ".*", []).append(pattern)
    merged: dict[str, list[str]] = {}
    for module, patterns in modules.items():
        names = [name for pattern in patterns for name in groups[pattern]]
        if len(patterns) > 1 and len({specs[name] for name in names}) == 1:
            merged[module] = names
        else:
            merged.update({pattern: groups[pattern] for pattern in patterns})
    return merged


def parallelize_section(plan: Plan) -> str:
    """The ``def parallelize(build_model, session, args)`` of ``train.py`` for ``plan``."""
    lines = ["def parallelize(build_model, session, args):", SECTION_DOC, "    stages = ["]
    for stage in sorted(plan.stages, key=lambda s: s.index):
        lines += _stage_lines(stage)
    lines += [
        "    ]",
        f"    # {_schedule_choices(plan)}",
        f'    schedule = runtime.schedule("{plan.schedule}", microbatches={plan.num_microbatches}, '
        f"virtual_stages={plan.virtual_stages})",
        f'    grad_sync = runtime.gradient_sync("{plan.grad_sync.label}")',
        "    return runtime.parallelize(",
        "        session, stages=stages, schedule=schedule, grad_sync=grad_sync, build_model=build_model,",
        "        loss_fn=loss_fn, model_file=MODEL_FILE, optimizer=args.optimizer, seed=args.seed,",
        "        check_parity=args.check_parity, compile=args.compile,",
        "    )",
    ]
    return "\n".join(lines)


def _stage_lines(stage: Stage) -> list[str]:
    modules = module_range(stage)
    names = axis_names(stage)
    axes = ", ".join(f"{name}={size}" for name, size in zip(names, stage.mesh_shape, strict=True))
    what = f"{modules[0]} … {modules[1]}" if modules else "no parameters"
    count = len(stage.param_placements)
    entries = placement_entries(stage)
    if len(entries) <= 1:
        placements = ["            placements={" + ", ".join(_entry(k, v) for k, v in entries.items()) + "},"]
    else:
        placements = ["            placements={", *(f"                {_entry(k, v)}," for k, v in entries.items())]
        placements.append("            },")
    return [
        f"        # stage {stage.index}: {what} ({count} parameters) on ranks {list(stage.devices)}",
        "        runtime.stage(",
        f"            {stage.index},",
        f"            modules={_modules_text(modules)},",
        f"            mesh=runtime.mesh({list(stage.devices)}, {axes}),",
        *placements,
        f'            zero={stage.zero}, recompute="{stage.remat}",',
        "        ),",
    ]


def _modules_text(modules: tuple[str, str] | None) -> str:
    return f'("{modules[0]}", "{modules[1]}")' if modules else "None"


def _entry(pattern: str, spec: tuple[str, ...]) -> str:
    return f'"{pattern}": {spec_text(spec)}'


def _schedule_choices(plan: Plan) -> str:
    """What the schedule line may be edited to."""
    if plan.schedule == Schedule.DATAFLOW:
        return "operator placements: microbatches flow; the microbatches may change"
    if len(plan.stages) == 1:
        return f"one stage: microbatches accumulate; any divisor of the batch of {plan.batch_size}"
    if plan.virtual_stages > 1:
        names = [str(s) for s in MULTI_STAGE_SCHEDULES]
    else:
        names = [str(Schedule.GPIPE), str(Schedule.ONE_F_ONE_B), str(Schedule.ZERO_BUBBLE)]
    chosen = SCHEDULE_NAMES.get(plan.schedule, plan.schedule)
    return (
        f"{chosen}; the schedule may be {', '.join(names)}; microbatches: a divisor of the batch of {plan.batch_size}"
    )
