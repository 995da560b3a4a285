"""The figure of ``plan show --figure out.png``: a plan on its device grid and its simulated step.

:func:`draw_plan` writes one PNG (matplotlib, Agg backend) with two panels:

1. **Device grid**: the cluster's devices as ``num_nodes`` rows of ``devices_per_node`` cells,
   each coloured by the stage that holds it and labelled ``S1 (2,2)[0,1]`` — stage index, the
   stage's mesh shape and the device's position in that mesh (row-major, as the executors
   reshape ``stage.devices``); devices no stage uses are grey. The legend gives per stage its
   devices, mesh, number of graph nodes and how many of its parameters are sharded.
2. **Timeline**: a Gantt chart of one simulated step (:class:`cost_models.simulator.Span`), one
   row per device (one row per stage when there are more than :data:`MAX_DEVICE_ROWS` devices)
   and one per link; forward, backward, step (gradient sync + optimizer) and transfer tasks in
   their own colours, microbatch numbers on the bars wide enough to hold them, x axis in ms.

The PNG is written beside its destination and renamed over it, so a failure leaves no half file.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cost_models.simulator import SimResult, Span
from planner.atomic_file import save_figure_atomic
from planner.plan import Plan, Stage

MAX_DEVICE_ROWS = 32  # more devices than this: one timeline row per stage
MAX_LINK_ROWS = 12  # more links than this: one timeline row per sending stage
UNUSED = "#d9d9d9"
KIND_COLORS = {"forward": "#4c8bd6", "backward": "#f0883e", "step": "#8e5bb5", "transfer": "#8a8a8a"}
FIGURE_WIDTH_IN = 13.0
DPI = 110
LEFT, RIGHT = 0.11, 0.70  # of the width: the legends sit right of the panels
TOP_IN, GAP_IN, BOTTOM_IN = 0.55, 1.0, 0.55
_COMPUTE = re.compile(r"^([FB])(\d+) c\d+$")
_TRANSFER = re.compile(r"^([FB])(\d+) \d+>\d+$")


@dataclass(frozen=True, kw_only=True)
class Bar:
    row: str
    start_s: float
    end_s: float
    kind: str  # forward, backward, step or transfer
    label: str  # microbatch ("F3", "B0") or "step"


def stage_colors(num_stages: int) -> list[tuple[float, ...]]:
    """One colour per stage: tab10 up to 10 stages, tab20 beyond (cycling after 20)."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if num_stages <= 10 else "tab20"]
    return [cmap(s % cmap.N) for s in range(num_stages)]


def mesh_position(stage: Stage, device: int) -> tuple[int, ...]:
    """Where ``device`` sits in its stage's mesh: ``stage.devices`` reshaped row-major to ``mesh_shape``."""
    flat, position = stage.devices.index(device), []
    for size in reversed(stage.mesh_shape):
        position.append(flat % size)
        flat //= size
    return tuple(reversed(position))


def device_label(stage: Stage, device: int) -> str:
    """``S1 (2,2)[0,1]``; just ``S1`` for a one-device stage."""
    if len(stage.devices) == 1:
        return f"S{stage.index}"
    shape = ",".join(map(str, stage.mesh_shape))
    return f"S{stage.index} ({shape})[{','.join(map(str, mesh_position(stage, device)))}]"


def stage_legend(stage: Stage) -> str:
    sharded = sum(any(p.startswith("S") for p in spec) for spec in stage.param_placements.values())
    mesh = "×".join(map(str, stage.mesh_shape))
    return (
        f"S{stage.index}: {len(stage.devices)} dev, mesh {mesh}, {len(stage.nodes)} nodes, "
        f"{sharded}/{len(stage.param_placements)} params sharded"
        f"{f', {stage.remat} remat' if stage.remat else ''}{f', ZeRO-{stage.zero}' if stage.zero else ''}"
    )


def timeline_rows(plan: Plan, spans: Sequence[Span]) -> tuple[list[str], dict[str, list[str]]]:
    """The row names top to bottom, and for each span resource the rows its bars go on."""
    by_device = sum(len(stage.devices) for stage in plan.stages) <= MAX_DEVICE_ROWS
    rows: list[str] = []
    rows_of: dict[str, list[str]] = {}
    for stage in sorted(plan.stages, key=lambda s: s.index):
        mine = [f"dev {d} (S{stage.index})" for d in stage.devices] if by_device else [_stage_row(stage)]
        rows += mine
        rows_of[f"stage {stage.index}"] = mine
    links = sorted({span.resource for span in spans if span.resource.startswith("link ")}, key=_link_key)
    for link in links:
        a, b = _link_key(link)
        row = f"link S{a}→S{b}" if len(links) <= MAX_LINK_ROWS else f"links from S{a}"
        if row not in rows:
            rows.append(row)
        rows_of[link] = [row]
    return rows, rows_of


def _stage_row(stage: Stage) -> str:
    devices = stage.devices
    contiguous = list(devices) == list(range(devices[0], devices[0] + len(devices)))
    where = f"{devices[0]}..{devices[-1]}" if contiguous and len(devices) > 1 else ",".join(map(str, devices))
    return f"S{stage.index} (dev {where})"


def _link_key(resource: str) -> tuple[int, int]:
    a, b = resource.removeprefix("link ").split(">")
    return int(a), int(b)


def classify(span: Span) -> tuple[str, str]:
    """(kind, label) of a simulator span, from the task names :mod:`planner.costing.lowering` gives."""
    if span.resource.startswith("link "):
        match = _TRANSFER.match(span.task)
        return "transfer", f"{match.group(1)}{match.group(2)}" if match else ""
    if span.task.startswith("step"):
        return "step", "step"
    match = _COMPUTE.match(span.task)
    if match is None:
        return "forward", ""
    return ("forward" if match.group(1) == "F" else "backward"), f"{match.group(1)}{match.group(2)}"


def timeline_bars(plan: Plan, spans: Sequence[Span]) -> tuple[list[str], list[Bar]]:
    rows, rows_of = timeline_rows(plan, spans)
    bars = []
    for span in spans:
        if span.end_s <= span.start_s or span.resource not in rows_of:
            continue
        kind, label = classify(span)
        bars += [
            Bar(row=row, start_s=span.start_s, end_s=span.end_s, kind=kind, label=label)
            for row in rows_of[span.resource]
        ]
    return rows, bars


def _draw_grid(ax, plan: Plan, colors: list[tuple[float, ...]]) -> None:
    from matplotlib.patches import Patch, Rectangle

    cluster = plan.cluster
    owner = {d: stage for stage in plan.stages for d in stage.devices}
    columns = cluster.devices_per_node
    fontsize = max(5.0, min(9.0, 80.0 / columns))
    for device in range(cluster.num_devices):
        node, column = divmod(device, columns)
        stage = owner.get(device)
        color = colors[stage.index] if stage is not None else UNUSED
        ax.add_patch(Rectangle((column + 0.04, node + 0.06), 0.92, 0.88, facecolor=color, edgecolor="white"))
        text = f"dev {device}\n{device_label(stage, device) if stage is not None else 'unused'}"
        ax.text(
            column + 0.5,
            node + 0.5,
            text,
            ha="center",
            va="center",
            fontsize=fontsize,
            color="black" if stage is None or _is_light(color) else "white",
        )
    ax.set_xlim(0, columns)
    ax.set_ylim(cluster.num_nodes, 0)
    ax.set_xticks([c + 0.5 for c in range(columns)], [str(c) for c in range(columns)], fontsize=7)
    ax.set_yticks([n + 0.5 for n in range(cluster.num_nodes)], [f"node {n}" for n in range(cluster.num_nodes)])
    ax.set_xlabel("device in node", fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    handles = [
        Patch(facecolor=colors[s.index], label=stage_legend(s)) for s in sorted(plan.stages, key=lambda s: s.index)
    ]
    if len(owner) < cluster.num_devices:
        handles.append(Patch(facecolor=UNUSED, label=f"unused: {cluster.num_devices - len(owner)} dev"))
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=7,
        frameon=False,
        ncol=1 + (len(handles) - 1) // 12,
    )


def _is_light(color: tuple[float, ...]) -> bool:
    red, green, blue = color[:3]
    return 0.299 * red + 0.587 * green + 0.114 * blue > 0.6


def _draw_bars(ax, rows: list[str], bars: list[Bar], *, makespan_ms: float, plot_width_px: float) -> None:
    """One ``broken_barh`` per row and kind; a microbatch label on every bar wide enough for it."""
    y_of = {row: y for y, row in enumerate(rows)}
    groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for bar in bars:
        groups.setdefault((bar.row, bar.kind), []).append((bar.start_s * 1e3, (bar.end_s - bar.start_s) * 1e3))
    for (row, kind), ranges in groups.items():
        ax.broken_barh(
            ranges,
            (y_of[row] - 0.36, 0.72),
            facecolors=KIND_COLORS[kind],
            edgecolor="white",
            linewidth=0.4,
            alpha=0.75 if kind == "transfer" else 1.0,
        )
    for bar in bars:
        width = (bar.end_s - bar.start_s) * 1e3
        if bar.label and width / makespan_ms * plot_width_px >= 7 * len(bar.label) + 4:
            ax.text(
                bar.start_s * 1e3 + width / 2,
                y_of[bar.row],
                bar.label,
                ha="center",
                va="center",
                fontsize=6,
                color="black" if bar.kind == "transfer" else "white",
            )


def _draw_timeline(ax, plan: Plan, result: SimResult, *, plot_width_px: float) -> None:
    from matplotlib.patches import Patch

    rows, bars = timeline_bars(plan, result.spans)
    makespan_ms = max(result.step_time_s * 1e3, 1e-9)
    _draw_bars(ax, rows, bars, makespan_ms=makespan_ms, plot_width_px=plot_width_px)
    ax.set_yticks(range(len(rows)), rows, fontsize=max(5.0, min(8.0, 260.0 / max(len(rows), 1))))
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, makespan_ms * 1.01)
    ax.set_xlabel("time in the simulated step (ms)", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    labels = {"forward": "forward", "backward": "backward", "step": "gradient sync + optimizer", "transfer": "transfer"}
    ax.legend(
        handles=[Patch(facecolor=c, label=labels[k]) for k, c in KIND_COLORS.items()],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=7,
        frameon=False,
    )
    ax.set_title(
        f"simulated step {result.step_time_s * 1e3:.4g} ms, bubble {result.bubble_fraction:.0%} "
        f"({plan.num_microbatches} microbatch(es), schedule {plan.schedule})",
        fontsize=9,
    )


def draw_plan(plan: Plan, result: SimResult, path: Path) -> None:
    """Write the two-panel PNG of ``plan`` and its recorded simulation ``result`` to ``path``."""
    from matplotlib.figure import Figure

    rows, _ = timeline_rows(plan, result.spans)
    grid_in = 0.75 * plan.cluster.num_nodes + 0.9
    timeline_in = 0.24 * len(rows) + 1.2
    height_in = TOP_IN + grid_in + GAP_IN + timeline_in + BOTTOM_IN
    fig = Figure(figsize=(FIGURE_WIDTH_IN, height_in))
    grid_ax, time_ax = fig.subplots(2, 1, gridspec_kw={"height_ratios": [grid_in, timeline_in]})
    fig.subplots_adjust(
        left=LEFT,
        right=RIGHT,
        top=1 - TOP_IN / height_in,
        bottom=BOTTOM_IN / height_in,
        hspace=2 * GAP_IN / (grid_in + timeline_in),
    )
    _draw_grid(grid_ax, plan, stage_colors(max(len(plan.stages), 1)))
    grid_ax.set_title(_title(plan), fontsize=10)
    _draw_timeline(time_ax, plan, result, plot_width_px=(RIGHT - LEFT) * FIGURE_WIDTH_IN * DPI)
    _save_png(fig, path)


def _title(plan: Plan) -> str:
    cluster, model = plan.cluster, plan.model
    args = ", ".join(f"{key}={value}" for key, value in model.args.items())
    name = Path(model.file).name if model.file else "model"
    return (
        f"{plan.method} plan for {name}{f' ({args})' if args else ''}: {len(plan.stages)} stage(s) on "
        f"{cluster.num_nodes} × {cluster.devices_per_node} {cluster.device.name}, batch {plan.batch_size}"
    )


def _save_png(fig, path: Path) -> None:
    save_figure_atomic(fig, path, dpi=DPI)
