"""The device-grid panel of ``plan show --figure``: which stages each device of the cluster hosts.

:func:`draw_grid` draws the cluster's devices as ``num_nodes`` rows of ``devices_per_node`` cells. Each
cell has a header ``dev 5`` and one band per stage the device hosts (:func:`stages_by_device`: several
under the interleaved and zero-bubble schedules, where stage ``k`` runs on the devices of stage
``k mod P``), each band in its stage's colour (:func:`stage_colors`) and labelled ``S1 (2,2)[0,1]`` —
stage index, the stage's mesh shape and the device's position in that mesh (:func:`mesh_position`,
row-major, as the executors reshape ``stage.devices``); devices no stage uses are grey. The legend, right
of the axes, gives per stage its devices, mesh, number of operators (graph nodes; "nodes" elsewhere in the
figure are cluster machines) and how many of its parameters are sharded (:func:`stage_legend`).
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.plan import Plan, Stage

UNUSED = "#d9d9d9"
HEADER = 0.24  # of a cell's height: the "dev N" line above the stage bands


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
        f"S{stage.index}: {len(stage.devices)} dev, mesh {mesh}, {len(stage.nodes)} operators, "
        f"{sharded}/{len(stage.param_placements)} params sharded"
        f"{f', {stage.remat} remat' if stage.remat else ''}{f', ZeRO-{stage.zero}' if stage.zero else ''}"
    )


def stages_by_device(plan: Plan) -> dict[int, list[Stage]]:
    """Every stage each used device hosts, in stage order."""
    hosted: dict[int, list[Stage]] = {}
    for stage in sorted(plan.stages, key=lambda s: s.index):
        for device in stage.devices:
            hosted.setdefault(device, []).append(stage)
    return hosted


def _draw_cell(ax, *, column: int, node: int, device: int, stages: Sequence[Stage], colors, fontsize: float) -> None:
    """One device: its header, then a band per stage it hosts (one grey band when it hosts none)."""
    from matplotlib.patches import Rectangle

    left, top, width, height = column + 0.04, node + 0.06, 0.92, 0.88
    ax.add_patch(Rectangle((left, top), width, height * HEADER, facecolor="#f2f2f2", edgecolor="white"))
    ax.text(column + 0.5, top + height * HEADER / 2, f"dev {device}", ha="center", va="center", fontsize=fontsize)
    band = height * (1 - HEADER) / max(len(stages), 1)
    for k, stage in enumerate(stages or [None]):
        color = UNUSED if stage is None else colors[stage.index]
        y = top + height * HEADER + k * band
        ax.add_patch(Rectangle((left, y), width, band, facecolor=color, edgecolor="white"))
        ax.text(
            column + 0.5,
            y + band / 2,
            "unused" if stage is None else device_label(stage, device),
            ha="center",
            va="center",
            fontsize=fontsize,
            color="black" if stage is None or _is_light(color) else "white",
        )


def draw_grid(ax, plan: Plan, colors: Sequence[tuple[float, ...]]) -> None:
    """The device grid of ``plan`` on ``ax``, its stage legend right of the axes."""
    cluster = plan.cluster
    hosted = stages_by_device(plan)
    columns = cluster.devices_per_node
    per_cell = max((len(stages) for stages in hosted.values()), default=1)
    fontsize = max(5.0, min(9.0, 80.0 / columns, 24.0 / (per_cell + 1)))
    for device in range(cluster.num_devices):
        node, column = divmod(device, columns)
        stages = hosted.get(device, [])
        _draw_cell(ax, column=column, node=node, device=device, stages=stages, colors=colors, fontsize=fontsize)
    ax.set_xlim(0, columns)
    ax.set_ylim(cluster.num_nodes, 0)
    ax.set_xticks([c + 0.5 for c in range(columns)], [str(c) for c in range(columns)], fontsize=7)
    ax.set_yticks([n + 0.5 for n in range(cluster.num_nodes)], [f"node {n}" for n in range(cluster.num_nodes)])
    ax.set_xlabel("device in node", fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    _grid_legend(ax, plan, colors, num_used=len(hosted))


def _grid_legend(ax, plan: Plan, colors: Sequence[tuple[float, ...]], *, num_used: int) -> None:
    from matplotlib.patches import Patch

    handles = [
        Patch(facecolor=colors[s.index], label=stage_legend(s)) for s in sorted(plan.stages, key=lambda s: s.index)
    ]
    unused = plan.cluster.num_devices - num_used
    if unused:
        handles.append(Patch(facecolor=UNUSED, label=f"unused: {unused} dev"))
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
