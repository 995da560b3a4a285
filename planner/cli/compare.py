"""``plan compare MODEL_FILE --cluster ... --batch-size B``: every method by the one estimate each prints.

Prints one row per method (the plan's estimated step time — what ``plan`` prints for it and what auto chose by —,
how many times the best it is, memory per device, whether it fits, the plan's pipeline bubble, the simulator's
replay of the plan as a check, search seconds and notes); ``--json`` prints the rows as a JSON list;
``--figure out.png`` draws them as a bar chart. The logic is :mod:`planner.compare`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from cost_models.units import GIB
from planner.atomic_file import save_figure_atomic
from planner.options import Method


def _parser() -> argparse.ArgumentParser:
    from planner.cli.options import UsageParser, add_cluster_options, add_model_options, add_search_options
    from planner.compare import COMPARE_METHODS

    parser = UsageParser(
        prog="plan compare",
        description=(
            "Plan the model with every method (autoplan's search, the hand-written Megatron, uniform-pipeline and "
            "data-parallel plans, and the device-placement baselines hash, critical-path, multi-objective, m-etf and "
            "rl) and print one row per method: its plan's estimated step time (the number `plan` prints for that plan "
            "and the one auto chooses by), how many times the best it is, memory per device, whether it fits, the "
            "plan's pipeline bubble, the step of the plan replayed in the discrete-event simulator (a check of the "
            "estimate; rows that differ by more than 10%% say why) and search seconds."
        ),
    )
    add_model_options(parser)
    add_cluster_options(parser, required=True)
    add_search_options(parser)
    parser.add_argument(
        "--methods", default=None, metavar="A,B,...", help=f"methods to compare (default: {','.join(COMPARE_METHODS)})"
    )
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list instead of a table")
    parser.add_argument("--figure", default=None, metavar="OUT.png", help="also draw the rows as a bar chart")
    return parser


def run_compare(argv: Sequence[str]) -> int:
    from planner.cli.options import figure_path, model_cluster, plan_options, prepare_from_options
    from planner.compare import best_step_s, compare, parse_methods
    from planner.plan.shape import count_of

    options = _parser().parse_args(list(argv))
    chosen = plan_options(options)
    methods = parse_methods(options.methods)
    figure = figure_path(options.figure)
    cluster = model_cluster(options)
    prepared = prepare_from_options(options, cluster=cluster, chosen=chosen)
    rows = compare(prepared, methods, progress=_progress_line)
    best = best_step_s(rows)
    if figure is not None:
        draw_comparison(rows, figure, title=f"{options.model_file} on {cluster.num_devices} × {cluster.device.name}")
    if options.json:
        print(json.dumps([row.to_json(best_s=best) for row in rows], indent=2))
    else:
        machines = f"{count_of(cluster.num_nodes, 'node')} × {cluster.devices_per_node} {cluster.device.name}"
        _print_table(rows, best, title=f"{options.model_file}, batch {options.batch_size}, {cluster.name} ({machines})")
        if figure is not None:
            print(f"wrote {figure}")
    return 0


def _progress_line(method: str) -> None:
    import sys

    if sys.stderr.isatty():
        sys.stderr.write(f"\r{' ' * 60}\rplanning with {method} ...")
        sys.stderr.flush()


def _print_table(rows, best: float | None, *, title: str) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table

    if sys.stderr.isatty():
        sys.stderr.write(f"\r{' ' * 60}\r")
    table = Table(title=title)
    columns = ("method", "step s", "× best", "GiB / device", "fits", "pipeline bubble", "simulated s", "search s")
    for column in columns:
        table.add_column(column, justify="left" if column == "method" else "right")
    for row in rows:
        ran = row.step_time_s is not None
        table.add_row(
            row.method,
            f"{row.step_time_s:.4g}" if ran else "-",
            f"{row.step_time_s / best:.2f}" if ran and best else "-",
            f"{row.memory_per_device_bytes / GIB:.2f}" if ran else "-",
            "yes" if row.fits else "no",
            f"{row.bubble_fraction:.0%}" if row.bubble_fraction is not None else "-",
            f"{row.simulated_step_time_s:.4g}" if row.simulated_step_time_s is not None else "-",
            f"{row.search_time_s:.1f}",
        )
    console = Console(width=160)
    console.print(table)
    for row in rows:
        if row.note:
            console.print(f"{row.method}: {row.note}", highlight=False)


def draw_comparison(rows, path: Path, *, title: str) -> None:
    """A horizontal bar per method: its estimated step time; plans that do not fit are hatched and grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [row for row in rows if row.step_time_s is not None]
    fig, ax = plt.subplots(figsize=(8, 0.45 * max(len(rows), 3) + 1.2))
    names = [row.method for row in shown]
    times = [row.step_time_s for row in shown]
    colors = ["#2b6cb0" if row.method == Method.AUTO else ("#718096" if row.fits else "#cbd5e0") for row in shown]
    bars = ax.barh(names, times, color=colors)
    for bar, row in zip(bars, shown, strict=True):
        if not row.fits:
            bar.set_hatch("//")
        ax.text(
            bar.get_width(),
            bar.get_y() + bar.get_height() / 2,
            f" {row.step_time_s:.3g} s" + ("" if row.fits else " (does not fit)"),
            va="center",
            fontsize=8,
        )
    missing = [row.method for row in rows if row.step_time_s is None]
    ax.invert_yaxis()
    ax.set_xlabel("estimated step time (s)" + (f"; no plan: {', '.join(missing)}" if missing else ""))
    ax.set_title(title, fontsize=10)
    ax.set_xlim(0, max(times, default=1) * 1.25)
    fig.tight_layout()
    try:
        save_figure_atomic(fig, path)
    finally:
        plt.close(fig)
