"""The choices each stage uses and what each saved (:mod:`planner.plan.choices`): a rich table for ``plan --explain``,
lines of text for ``plan show``."""

from __future__ import annotations

from rich.table import Table

from cost_models.units import GIB, MIB
from planner.plan.choices import ChoiceSaving, PlanChoices, StageChoices
from planner.plan.report import device_range

TITLE = "choices per stage: what each saved per step and per device against the next-best option"


def _size(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.3g} GiB" if num_bytes >= 0.1 * GIB else f"{num_bytes / MIB:.3g} MiB"


def saving_text(saving: ChoiceSaving) -> str:
    """``sequence parallel: 0.0068 ms less per step and 1.05 MiB less per device than no sequence parallelism``."""
    seconds = f"{abs(saving.saved_s) * 1e3:.3g} ms {'less' if saving.saved_s >= 0 else 'more'} per step"
    size = saving.saved_bytes
    memory = "" if size is None else f" and {_size(abs(size))} {'less' if size >= 0 else 'more'} per device"
    what = saving.kind if saving.choice == saving.kind else f"{saving.kind} ({saving.choice})"
    return f"{what}: {seconds}{memory} than {saving.next_best}"


def _where(row: StageChoices) -> str:
    return f"devices {device_range(row.devices)} (mesh {'×'.join(str(size) for size in row.mesh_shape)})"


def _settings(row: StageChoices) -> tuple[str, ...]:
    return (row.schedule, row.recomputation, row.zero, "yes" if row.sequence_parallel else "no", row.grad_sync)


def choices_table(choices: PlanChoices) -> Table:
    table = Table(title=TITLE)
    for column in ("stage", "devices", "schedule", "recomputation", "ZeRO", "sequence parallel", "grad sync", "saved"):
        table.add_column(column, justify="right" if column == "stage" else "left")
    for row in choices.stages:
        saved = "\n".join(saving_text(saving) for saving in row.savings) or "-"
        table.add_row(str(row.stage), _where(row).removeprefix("devices "), *_settings(row), saved)
    if choices.plan_savings:
        table.add_section()
        table.add_row("plan", "", "", "", "", "", "", "\n".join(saving_text(s) for s in choices.plan_savings))
    return table


def choices_text(choices: PlanChoices) -> str:
    """The table as lines: one per stage with its choices, one per saving under it, the whole plan's last."""
    lines = [f"{TITLE}:"]
    for row in choices.stages:
        schedule, remat, zero, sequence, sync = _settings(row)
        lines.append(
            f"  stage {row.stage}, {_where(row)}: schedule {schedule}; recomputation {remat}; ZeRO {zero}; "
            f"sequence parallel {sequence}; grad sync {sync}"
        )
        lines.extend(f"    saved: {saving_text(saving)}" for saving in row.savings)
    if choices.plan_savings:
        lines.append("  whole plan:")
        lines.extend(f"    saved: {saving_text(saving)}" for saving in choices.plan_savings)
    return "\n".join(lines)
