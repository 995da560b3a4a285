"""What ``plan tune`` writes and prints: the table of candidates, and the corrections it learned.

The table (``OUT.tune.md`` and ``OUT.tune.json`` beside the plan) has one row per candidate run: auto's candidate
name, the plan's shape, its estimated step and memory (the numbers ``plan`` prints for it), the measured median
step and the fullest rank's measured peak, their ratios, whether it fits, and which was kept; then the rule that
kept it and the corrections fitted. :func:`learn_into_calibration` writes the corrected cluster into this
machine's cached calibration (:mod:`calibration.store`).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from calibration.store import save_calibrated
from cost_models.cluster import Cluster
from cost_models.corrections import Corrections, apply_corrections
from planner.plan.shape import plan_shape
from planner.tuning import TuneResult, TuneRow

KEEP_RULE = (
    "kept: the least measured median step among the candidates that ran and whose measured peak fits the memory "
    "budget on every rank (the rule reads measurements only)"
)


def _row_json(row: TuneRow, *, kept: bool) -> dict:
    measured = row.measurement
    return {
        "candidate": row.name,
        "shape": plan_shape(row.plan),
        "estimate_s": row.estimate_s,
        "estimated_memory_bytes": row.plan.estimate.memory_per_device_bytes,
        "measured_s": measured.step_time_s,
        "measured_peak_bytes": list(measured.peak_memory_bytes),
        "disturbance": measured.disturbance,
        "error": measured.error,
        "fits": row.fits,
        "kept": kept,
    }


def _cells(row: TuneRow, *, kept: bool) -> list[str]:
    measured = row.measurement
    peak = max(measured.peak_memory_bytes, default=0.0)
    estimated_memory = row.plan.estimate.memory_per_device_bytes
    ran = measured.ran
    return [
        row.name + (" (kept)" if kept else ""),
        plan_shape(row.plan),
        f"{row.estimate_s * 1e3:.1f}",
        f"{measured.step_time_s * 1e3:.1f}" if ran else f"failed: {measured.error}",
        f"{measured.step_time_s / row.estimate_s:.2f}" if ran else "-",
        f"{estimated_memory / 2**20:.1f}",
        f"{peak / 2**20:.1f}" if ran else "-",
        f"{peak / estimated_memory:.2f}" if ran and estimated_memory else "-",
        "yes" if row.fits else "no",
    ]


HEADER = (
    "candidate",
    "plan",
    "estimate ms",
    "measured ms",
    "measured ÷ estimate",
    "estimated MiB",
    "measured peak MiB",
    "peak ÷ estimate",
    "fits",
)


def write_table(result: TuneResult, out: Path, *, command: str) -> Path:
    """``OUT.tune.md`` (and ``.json``) beside the plan; returns the markdown's path."""
    rows = [_cells(row, kept=index == result.chosen) for index, row in enumerate(result.rows)]
    lines = [
        f"# plan tune, {datetime.date.today().isoformat()}",
        "",
        f"Command: `{command}`",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
        *("| " + " | ".join(cells) + " |" for cells in rows),
        "",
        KEEP_RULE + ".",
        "",
        f"Corrections fitted to these measurements: {result.corrections.describe()}.",
    ]
    markdown = out.with_suffix(".tune.md")
    markdown.write_text("\n".join(lines) + "\n")
    data = {
        "command": command,
        "rows": [_row_json(row, kept=i == result.chosen) for i, row in enumerate(result.rows)],
        "kept": result.rows[result.chosen].name,
        "corrections": result.corrections.to_json(),
    }
    out.with_suffix(".tune.json").write_text(json.dumps(data, indent=2) + "\n")
    return markdown


def print_rows(result: TuneResult) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="plan tune: every candidate, estimated against measured")
    for column in HEADER:
        table.add_column(column, justify="left" if column in ("candidate", "plan") else "right")
    for index, row in enumerate(result.rows):
        table.add_row(*_cells(row, kept=index == result.chosen))
    console = Console(width=200)
    console.print(table)
    kept, auto = result.rows[result.chosen], result.rows[0]
    if result.chosen == 0:
        console.print(f"kept auto's pick ({auto.name}): it measured fastest", highlight=False)
    else:
        versus = f"{auto.measurement.step_time_s * 1e3:.1f} ms" if auto.measurement.ran else "nothing"
        console.print(
            f"kept {kept.name}: {kept.measurement.step_time_s * 1e3:.1f} ms a step; auto's pick "
            f"({auto.name}) measured {versus}",
            highlight=False,
        )


def corrected_cluster(cluster: Cluster, corrections: Corrections) -> Cluster:
    """``cluster`` with ``corrections`` applied, its calibration saying so (factors multiplied into any earlier)."""
    from dataclasses import replace

    earlier = Corrections.from_json((cluster.calibration or {}).get("corrections", {}))
    total = Corrections(**{key: getattr(earlier, key) * value for key, value in corrections.to_json().items()})
    summary = {
        **(cluster.calibration or {"by": "plan tune"}),
        "corrections": total.to_json(),
        "tuned_on": datetime.date.today().isoformat(),
    }
    return replace(apply_corrections(cluster, corrections), calibration=summary)


def learn_into_calibration(result: TuneResult, cluster: Cluster) -> str:
    """Write the corrected cluster into this machine's cached calibration; the line that says so."""
    corrected = corrected_cluster(cluster, result.corrections)
    path = save_calibrated(corrected.to_json(), cluster.name, processes=cluster.num_devices)
    return (
        f"learned: {result.corrections.describe()}; written to {path}: the next plan on {cluster.name} with "
        f"{cluster.num_devices} devices starts from them"
    )
