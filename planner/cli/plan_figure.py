"""The figure of ``plan show --figure out.png``: a plan on its device grid and its simulated step.

:func:`draw_plan` writes one PNG (matplotlib, Agg backend) of the figure :func:`plan_figure` builds, two panels:

1. **Device grid** (:mod:`planner.cli.plan_figure_grid`): the cluster's devices, each with a band per stage it
   hosts — every virtual stage under the interleaved and zero-bubble schedules — coloured by stage and labelled
   with the stage's mesh and the device's place in it; the legend gives each stage's devices, mesh, operators
   (graph nodes) and sharded parameters.
2. **Timeline** (:mod:`planner.cli.plan_figure_timeline`): a Gantt chart of one simulated step
   (:class:`cost_models.simulator.Span`), a row per device (per pipeline rank on large clusters) and per link;
   forward, backward (zero bubble: its input-gradient ``I`` and hatched weight-gradient ``W`` parts), step and
   transfer tasks in their own colours, microbatch numbers on the bars wide enough to hold them, a strip in the
   stage's colour under each bar when a rank holds several stages, x axis in ms.

Both legends sit right of their panels; the PNG is saved with ``bbox_inches="tight"``, so the page grows to hold
them. It is written beside its destination and renamed over it, so a failure leaves no half file. "Nodes" in the
figure are the cluster's machines only; the graph's nodes are called operators.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cost_models.simulator import SimResult
from planner.atomic_file import save_figure_atomic
from planner.cli.plan_figure_grid import draw_grid, stage_colors, stages_by_device
from planner.cli.plan_figure_timeline import draw_timeline, timeline_rows
from planner.plan import Plan

FIGURE_WIDTH_IN = 13.0
DPI = 110
LEFT, RIGHT = 0.11, 0.70  # of the width: the legends sit right of the panels
TOP_IN, GAP_IN, BOTTOM_IN = 0.55, 1.0, 0.55


def plan_figure(plan: Plan, result: SimResult) -> Any:
    """The two-panel :class:`matplotlib.figure.Figure` of ``plan`` and its recorded simulation ``result``."""
    from matplotlib.figure import Figure

    rows, _ = timeline_rows(plan, result.spans)
    per_cell = max((len(stages) for stages in stages_by_device(plan).values()), default=1)
    grid_in = (0.75 + 0.3 * (per_cell - 1)) * plan.cluster.num_nodes + 0.9
    timeline_in = 0.24 * len(rows) + 1.2
    height_in = TOP_IN + grid_in + GAP_IN + timeline_in + BOTTOM_IN
    fig = Figure(figsize=(FIGURE_WIDTH_IN, height_in), dpi=DPI)
    grid_ax, time_ax = fig.subplots(2, 1, gridspec_kw={"height_ratios": [grid_in, timeline_in]})
    fig.subplots_adjust(
        left=LEFT,
        right=RIGHT,
        top=1 - TOP_IN / height_in,
        bottom=BOTTOM_IN / height_in,
        hspace=2 * GAP_IN / (grid_in + timeline_in),
    )
    colors = stage_colors(max(len(plan.stages), 1))
    draw_grid(grid_ax, plan, colors)
    grid_ax.set_title(_title(plan), fontsize=10)
    draw_timeline(time_ax, plan, result, colors=colors, plot_width_px=(RIGHT - LEFT) * FIGURE_WIDTH_IN * DPI)
    return fig


def draw_plan(plan: Plan, result: SimResult, path: Path) -> None:
    """Write the two-panel PNG of ``plan`` and its recorded simulation ``result`` to ``path``."""
    save_figure_atomic(plan_figure(plan, result), path, dpi=DPI, tight=True)


def _title(plan: Plan) -> str:
    cluster, model = plan.cluster, plan.model
    args = ", ".join(f"{key}={value}" for key, value in model.args.items())
    name = Path(model.file).name if model.file else "model"
    return (
        f"{plan.method} plan for {name}{f' ({args})' if args else ''}: {len(plan.stages)} stage(s) on "
        f"{cluster.num_nodes} node(s) × {cluster.devices_per_node} {cluster.device.name}, batch {plan.batch_size}"
    )
