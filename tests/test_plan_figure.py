"""``plan show --figure`` draws every schedule: busy rows for every stage and virtual stage, zero bubble's split
backward, every virtual stage on the device grid, legends inside the saved PNG, operators never called nodes.

The checks read the data the figure draws (rows and their bars, the grid's texts, the legends' boxes), not pixels.
"""

from __future__ import annotations

import functools
import re
import struct
from dataclasses import replace
from pathlib import Path

import pytest

from cost_models.cluster import load_cluster
from cost_models.simulator import SimResult, Span
from planner.api import plan_model_file
from planner.cli.plan_figure import DPI, draw_plan, plan_figure
from planner.cli.plan_figure_grid import stage_legend, stages_by_device
from planner.cli.plan_figure_timeline import bucket_owners, classify, timeline_bars, timeline_rows
from planner.cli.show import simulate_recorded
from planner.plan import Plan
from tests.conftest import EXAMPLES

SCHEDULES = {  # name -> plan options: every schedule a plan can have
    "gpipe": {"method": "megatron", "degrees": (1, 4, 2), "schedule": "gpipe", "microbatches": 4},
    "1f1b": {"method": "megatron", "degrees": (1, 4, 2), "schedule": "1f1b", "microbatches": 4},
    "interleaved": {"method": "megatron", "degrees": (1, 2, 4), "schedule": "interleaved", "microbatches": 4},
    "zero-bubble": {"method": "auto", "schedule": "zero-bubble", "max_stages": 4, "microbatches": 4},
    "data-parallel": {"method": "data-parallel"},
}
BACKWARD = {"backward", "input-grad"}


@functools.cache
def planned(name: str) -> tuple[Plan, SimResult]:
    cluster = load_cluster("p3.16xlarge", num_nodes=1)
    plan = plan_model_file(
        EXAMPLES / "mlp.py", cluster, batch_size=16, model_args={"layers": 8, "hidden": 256}, **SCHEDULES[name]
    )
    return plan, simulate_recorded(plan)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_device_row_and_every_stage_is_busy(name: str) -> None:
    plan, result = planned(name)
    rows, bars = timeline_bars(plan, result.spans)
    kinds_on = {row: {bar.kind for bar in bars if bar.row == row} for row in rows}
    for row in rows:
        if row.startswith("link"):
            assert kinds_on[row] == {"transfer"}, row
        else:
            assert "forward" in kinds_on[row] and kinds_on[row] & BACKWARD, (row, kinds_on[row])
    for stage in plan.stages:  # every stage, and every virtual stage of a rank, runs forwards and backwards
        kinds = {bar.kind for bar in bars if bar.stage == stage.index}
        assert "forward" in kinds and kinds & BACKWARD, (stage.index, kinds)
        if plan.schedule == "zero-bubble":
            assert {"input-grad", "weight-grad"} <= kinds and "backward" not in kinds
    if name in ("interleaved", "zero-bubble"):
        assert plan.schedule == name and plan.virtual_stages >= 2
        assert all(re.search(r"\(S\d+,S\d+\)$", row) for row in rows if row.startswith("dev "))
    if name == "data-parallel":
        assert len(plan.stages) == 1 and not any(row.startswith("link") for row in rows)


@pytest.mark.parametrize("name", ["interleaved", "zero-bubble"])
def test_the_grid_shows_every_virtual_stage_a_device_hosts(name: str) -> None:
    plan, result = planned(name)
    hosted = stages_by_device(plan)
    assert all(len(stages) == plan.virtual_stages for stages in hosted.values())
    texts = {text.get_text() for text in plan_figure(plan, result).axes[0].texts}
    for stage in plan.stages:
        assert any(text.startswith(f"S{stage.index} (") for text in texts), (stage.index, texts)


def _png_size(path: Path) -> tuple[int, int]:
    width, height = struct.unpack(">II", path.read_bytes()[16:24])  # the IHDR chunk
    return width, height


@pytest.mark.parametrize("name", ["zero-bubble", "data-parallel"])
def test_the_legends_lie_inside_the_saved_png(name: str, tmp_path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    plan, result = planned(name)
    figure = plan_figure(plan, result)
    renderer = FigureCanvasAgg(figure).get_renderer()
    page = figure.get_tightbbox(renderer)  # inches: what bbox_inches="tight" saves, less its padding
    path = tmp_path / "plan.png"
    draw_plan(plan, result, path)
    width_px, height_px = _png_size(path)
    assert abs(width_px - (page.width + 0.2) * DPI) <= 2 and abs(height_px - (page.height + 0.2) * DPI) <= 2
    legends = [ax.get_legend() for ax in figure.axes]
    assert len(legends) == 2 and all(legend is not None for legend in legends)
    for legend in legends:
        box = legend.get_window_extent(renderer)
        left_px, right_px = (box.x0 / figure.dpi - page.x0 + 0.1) * DPI, (box.x1 / figure.dpi - page.x0 + 0.1) * DPI
        assert left_px >= 0 and right_px <= width_px, (left_px, right_px, width_px)
        assert box.y0 / figure.dpi >= page.y0 and box.y1 / figure.dpi <= page.y1


def test_operators_are_never_called_nodes() -> None:
    import matplotlib.text

    plan, result = planned("zero-bubble")
    assert "operators" in stage_legend(plan.stages[0]) and "nodes" not in stage_legend(plan.stages[0])
    texts = [text.get_text() for text in plan_figure(plan, result).findobj(matplotlib.text.Text)]
    assert any("operators" in text for text in texts)
    assert not [text for text in texts if re.search(r"\bnodes\b", text)]


def test_the_split_backward_and_bucket_syncs_are_told_apart() -> None:
    def span(task: str, resource: str = "rank 0", start_s: float = 0.0) -> Span:
        return Span(task=task, resource=resource, start_s=start_s, end_s=start_s + 1.0)

    assert classify(span("I3 c4")) == ("input-grad", "I3")
    assert classify(span("W3 c4")) == ("weight-grad", "W3")
    assert classify(span("B1 c0 part 2", "stage 0")) == ("backward", "B1")
    assert classify(span("sync bucket 0", "B3 c0 sync")) == ("grad-sync", "")
    plan, _ = planned("zero-bubble")  # ranks: stages (0, 4) on rank 0, (1, 5) on rank 1, ...
    spans = [span("W3 c4", "rank 0"), span("W3 c5", "rank 1", 5.0), span("sync bucket 0", "sync after 99", 1.0)]
    spans += [span("sync bucket 0", "B3 c5 sync", 2.0), span("sync bucket 0", "sync after 7", 3.0)]
    assert bucket_owners(plan, spans) == {"sync after 99": "rank 0", "B3 c5 sync": "rank 1"}


def test_large_clusters_get_a_row_per_rank_naming_its_virtual_stages() -> None:
    plan, _ = planned("interleaved")
    low, high = tuple(range(32)), tuple(range(32, 64))
    stages = [replace(stage, devices=low if stage.index % 2 == 0 else high, mesh_shape=(32,)) for stage in plan.stages]
    rows, rows_of = timeline_rows(replace(plan, stages=tuple(stages)), [])
    assert rows == ["S0,S2 (dev 0..31)", "S1,S3 (dev 32..63)"]
    assert rows_of == {"rank 0": ["S0,S2 (dev 0..31)"], "rank 1": ["S1,S3 (dev 32..63)"]}
