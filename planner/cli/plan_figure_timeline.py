"""The timeline panel of ``plan show --figure``: one simulated step as a Gantt chart, a row per device and link.

The simulator's spans (:class:`cost_models.simulator.Span`) carry the names
:mod:`planner.costing.lowered_tasks` gives: a *pipeline rank's* resource is ``stage g`` when it holds one
stage and ``rank g`` when it holds several (interleaved and zero-bubble schedules: stage ``k`` on the
devices of rank ``k mod P``), ranks numbered by their devices' first appearance in stage order
(:func:`pipeline_ranks`); a link between ranks is ``link a>b``. Compute tasks are ``F3 c2`` (forward of
microbatch 3, chunk 2), ``B3 c2`` (backward, ``B3 c2 part 1`` where its gradient buckets go out),
``I3 c2`` and ``W3 c2`` (zero bubble's backward for the inputs and, later, for the weights) and
``step s1``. In a pipeline chunk ``c`` *is* stage ``c`` (the lowering pipelines a plan only then), so
:func:`span_stage` names each compute bar's stage even where a rank holds several.

:func:`timeline_rows`: one row per device of each rank (``dev 0 (S0,S4)``: the stages it hosts), or one
per rank on more than :data:`MAX_DEVICE_ROWS` devices, then one per link (one per sending rank beyond
:data:`MAX_LINK_ROWS`). :func:`timeline_bars` puts each span on its rows as a :class:`Bar` of a kind
(:func:`classify`): forward, backward, backward for inputs, backward for weights (hatched), step, transfer, and
a bucket's gradient all-reduce (``sync bucket k``) on the rows of the rank whose gradients it sums
(:func:`bucket_owners`), drawn as a line above the row.
:func:`draw_timeline` draws them, a thin strip in the stage's colour under each compute bar when a rank
holds several stages, and a legend of the kinds present outside the axes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from cost_models.simulator import SimResult, Span
from planner.plan import Plan, Stage
from planner.plan.schedules import Schedule

MAX_DEVICE_ROWS = 32  # more devices than this: one timeline row per rank
MAX_LINK_ROWS = 12  # more links than this: one timeline row per sending rank
KIND_COLORS = {
    "forward": "#4c8bd6",
    "backward": "#f0883e",
    "input-grad": "#d9480f",
    "weight-grad": "#f7c873",
    "step": "#8e5bb5",
    "grad-sync": "#3f1d63",
    "transfer": "#8a8a8a",
}
KIND_LABELS = {
    "forward": "forward (F)",
    "backward": "backward (B)",
    "input-grad": "backward for inputs (I)",
    "weight-grad": "backward for weights (W)",
    "step": "step: optimizer (+ gradient sync not in buckets)",
    "grad-sync": "gradient all-reduce of a bucket (line above the row)",
    "transfer": "transfer",
}
HATCHES = {"weight-grad": "////"}
HATCH_EDGE = "#a86b00"  # the hatching's colour (matplotlib draws hatches in the edge colour)
_COMPUTE = re.compile(r"^([FBIW])(\d+) c(\d+)(?: part \d+)?$")
_TRANSFER = re.compile(r"^([FB])(\d+) \d+>\d+$")
_BUCKETS = re.compile(r"^[BIW]\d+ c(\d+) sync$")  # the buckets of a last backward, overlapped with it
_KIND_OF_LETTER = {"F": "forward", "B": "backward", "I": "input-grad", "W": "weight-grad"}


@dataclass(frozen=True, kw_only=True)
class Bar:
    row: str
    start_s: float
    end_s: float
    kind: str  # a key of KIND_COLORS
    label: str  # microbatch ("F3", "I0", "W0") or "step"
    stage: int | None = None  # the stage a compute or step bar runs; None for transfers


def pipeline_ranks(plan: Plan) -> list[tuple[Stage, ...]]:
    """The stages of each pipeline rank (a distinct device group), ranks in order of first appearance by stage."""
    ranks: dict[tuple[int, ...], list[Stage]] = {}
    for stage in sorted(plan.stages, key=lambda s: s.index):
        ranks.setdefault(tuple(stage.devices), []).append(stage)
    return [tuple(members) for members in ranks.values()]


def rank_resource(rank: int, members: Sequence[Stage]) -> str:
    """The simulator resource of pipeline rank ``rank`` (as :mod:`planner.costing.lowered_tasks` names it)."""
    return f"stage {rank}" if len(members) == 1 else f"rank {rank}"


def stages_text(members: Sequence[Stage]) -> str:
    """``S0`` or ``S0,S4``: the stages of one rank."""
    return ",".join(f"S{stage.index}" for stage in members)


def timeline_rows(plan: Plan, spans: Sequence[Span]) -> tuple[list[str], dict[str, list[str]]]:
    """The row names top to bottom, and for each span resource the rows its bars go on."""
    ranks = pipeline_ranks(plan)
    by_device = sum(len(members[0].devices) for members in ranks) <= MAX_DEVICE_ROWS
    rows: list[str] = []
    rows_of: dict[str, list[str]] = {}
    for g, members in enumerate(ranks):
        devices = members[0].devices
        mine = [f"dev {d} ({stages_text(members)})" for d in devices] if by_device else [_rank_row(members)]
        rows += mine
        rows_of[rank_resource(g, members)] = mine
    links = sorted({span.resource for span in spans if span.resource.startswith("link ")}, key=_link_key)
    several = any(len(members) > 1 for members in ranks)
    for link in links:
        a, b = _link_key(link)
        if len(links) > MAX_LINK_ROWS:
            row = f"links from rank {a}" if several else f"links from S{a}"
        else:
            row = f"link rank {a}→{b}" if several else f"link S{a}→S{b}"
        if row not in rows:
            rows.append(row)
        rows_of[link] = [row]
    return rows, rows_of


def _rank_row(members: Sequence[Stage]) -> str:
    devices = members[0].devices
    contiguous = list(devices) == list(range(devices[0], devices[0] + len(devices)))
    where = f"{devices[0]}..{devices[-1]}" if contiguous and len(devices) > 1 else ",".join(map(str, devices))
    return f"{stages_text(members)} (dev {where})"


def _link_key(resource: str) -> tuple[int, int]:
    a, b = resource.removeprefix("link ").split(">")
    return int(a), int(b)


def classify(span: Span) -> tuple[str, str]:
    """(kind, label) of a simulator span, from the task names :mod:`planner.costing.lowered_tasks` gives."""
    if span.resource.startswith("link "):
        match = _TRANSFER.match(span.task)
        return "transfer", f"{match.group(1)}{match.group(2)}" if match else ""
    if span.task.startswith("sync bucket"):
        return "grad-sync", ""
    if span.task.startswith("step"):
        return "step", "step"
    match = _COMPUTE.match(span.task)
    if match is None:
        return "forward", ""
    return _KIND_OF_LETTER[match.group(1)], f"{match.group(1)}{match.group(2)}"


def span_stage(span: Span, members: Sequence[Stage], *, pipelined: bool) -> int | None:
    """The stage a compute or step span on a rank holding ``members`` runs; None where it cannot be told."""
    if len(members) == 1:
        return members[0].index
    if span.task.startswith("step s"):
        return int(span.task.removeprefix("step s"))
    match = _COMPUTE.match(span.task)
    chunk = int(match.group(3)) if match else None
    return chunk if pipelined and chunk in {stage.index for stage in members} else None


def bucket_owners(plan: Plan, spans: Sequence[Span]) -> dict[str, str]:
    """Each bucket all-reduce resource -> the resource of the rank whose gradients it sums. ``B3 c2 sync`` (the
    buckets overlapped with chunk 2's last backward) by its chunk's stage; ``sync after N`` (zero bubble: after a
    stage's last ``W``) by the rank whose ``W`` ends when its first bucket starts, where only one does."""
    ranks = pipeline_ranks(plan)
    rank_of = {stage.index: rank_resource(g, members) for g, members in enumerate(ranks) for stage in members}
    w_ends: dict[float, set[str]] = {}
    first: dict[str, float] = {}
    for span in spans:
        if span.task.startswith("W") and span.resource in rank_of.values():
            w_ends.setdefault(span.end_s, set()).add(span.resource)
        if span.task.startswith("sync bucket"):
            first[span.resource] = min(first.get(span.resource, span.start_s), span.start_s)
    owners = {}
    for resource, start_s in first.items():
        match = _BUCKETS.match(resource)
        candidates = {rank_of.get(int(match.group(1)))} if match else w_ends.get(start_s, set())
        if len(candidates) == 1 and None not in candidates:
            owners[resource] = candidates.pop()
    return owners


def timeline_bars(plan: Plan, spans: Sequence[Span]) -> tuple[list[str], list[Bar]]:
    """The rows and the bars on them: one per span and row of its resource; a bucket all-reduce goes on its rank's
    rows (:func:`bucket_owners`)."""
    rows, rows_of = timeline_rows(plan, spans)
    for resource, owner in bucket_owners(plan, spans).items():
        rows_of[resource] = rows_of[owner]
    ranks = {rank_resource(g, members): members for g, members in enumerate(pipeline_ranks(plan))}
    pipelined = plan.schedule != Schedule.DATAFLOW
    bars = []
    for span in spans:
        if span.end_s <= span.start_s or span.resource not in rows_of:
            continue
        kind, label = classify(span)
        members = ranks.get(span.resource)
        stage = None if members is None else span_stage(span, members, pipelined=pipelined)
        bars += [
            Bar(row=row, start_s=span.start_s, end_s=span.end_s, kind=kind, label=label, stage=stage)
            for row in rows_of[span.resource]
        ]
    return rows, bars


def _draw_bars(ax, rows: list[str], bars: list[Bar], *, makespan_ms: float, plot_width_px: float, strips: bool) -> None:
    """One ``broken_barh`` per row and kind (a bucket all-reduce thin, above the row's compute); a microbatch label
    on every bar wide enough for it, raised above the stage strip when there is one."""
    y_of = {row: y for y, row in enumerate(rows)}
    groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for bar in bars:
        groups.setdefault((bar.row, bar.kind), []).append((bar.start_s * 1e3, (bar.end_s - bar.start_s) * 1e3))
    for (row, kind), ranges in groups.items():
        ax.broken_barh(
            ranges,
            (y_of[row] - 0.47, 0.1) if kind == "grad-sync" else (y_of[row] - 0.36, 0.72),
            facecolors=KIND_COLORS[kind],
            edgecolor=HATCH_EDGE if kind in HATCHES else "white",
            linewidth=0.4,
            hatch=HATCHES.get(kind),
            alpha=0.75 if kind == "transfer" else 1.0,
        )
    for bar in bars:
        width = (bar.end_s - bar.start_s) * 1e3
        if bar.label and width / makespan_ms * plot_width_px >= 7 * len(bar.label) + 4:
            dark = bar.kind in ("transfer", "weight-grad")
            ax.text(
                bar.start_s * 1e3 + width / 2,
                y_of[bar.row] - (0.06 if strips and bar.stage is not None else 0.0),
                bar.label,
                ha="center",
                va="center",
                fontsize=6,
                color="black" if dark else "white",
            )


def _draw_stage_strips(ax, rows: list[str], bars: list[Bar], colors: Sequence[tuple[float, ...]]) -> None:
    """A thin strip in its stage's colour (the grid's) along the bottom of every bar whose stage is known."""
    y_of = {row: y for y, row in enumerate(rows)}
    groups: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for bar in bars:
        if bar.stage is not None and bar.kind != "step":
            groups.setdefault((bar.row, bar.stage), []).append((bar.start_s * 1e3, (bar.end_s - bar.start_s) * 1e3))
    for (row, stage), ranges in groups.items():
        ax.broken_barh(ranges, (y_of[row] + 0.2, 0.16), facecolors=colors[stage], edgecolor="none")


def draw_timeline(
    ax, plan: Plan, result: SimResult, *, colors: Sequence[tuple[float, ...]], plot_width_px: float
) -> None:
    """The Gantt chart of ``result``'s spans on ``ax``, with its legend right of the axes."""
    from matplotlib.patches import Patch

    rows, bars = timeline_bars(plan, result.spans)
    makespan_ms = max(result.step_time_s * 1e3, 1e-9)
    several = plan.virtual_stages > 1
    _draw_bars(ax, rows, bars, makespan_ms=makespan_ms, plot_width_px=plot_width_px, strips=several)
    if several:
        _draw_stage_strips(ax, rows, bars, colors)
    ax.set_yticks(range(len(rows)), rows, fontsize=max(5.0, min(8.0, 260.0 / max(len(rows), 1))))
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, makespan_ms * 1.01)
    ax.set_xlabel("time in the simulated step (ms)", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    present = {bar.kind for bar in bars}
    handles = [
        Patch(
            facecolor=color,
            hatch=HATCHES.get(kind),
            edgecolor=HATCH_EDGE if kind in HATCHES else "white",
            label=KIND_LABELS[kind],
        )
        for kind, color in KIND_COLORS.items()
        if kind in present
    ]
    if several:
        handles.append(Patch(facecolor="none", edgecolor="none", label="strip under a bar: its stage (grid colours)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    ax.set_title(_timeline_title(plan, result), fontsize=9)


def _timeline_title(plan: Plan, result: SimResult) -> str:
    virtual = f", {plan.virtual_stages} virtual stages per rank" if plan.virtual_stages > 1 else ""
    return (
        f"simulated step {result.step_time_s * 1e3:.4g} ms, bubble {result.bubble_fraction:.0%} "
        f"({plan.num_microbatches} microbatch(es), schedule {plan.schedule}{virtual})"
    )
