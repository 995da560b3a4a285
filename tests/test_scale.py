"""Planning at scale without changing answers: stage problems reused by shape, hand-written methods
run alone, device numbering, microbatch counts, the forked second capture and Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cost_models.cluster import load_cluster
from planner.api import plan_prepared, prepare_model_file
from planner.baselines.handwritten import equal_spans
from planner.baselines.handwritten_plan import state_can_fit
from planner.inter.search import canonical_mesh, microbatch_counts
from planner.inter.stage_dp.device_blocks import Submesh
from planner.inter.stage_shapes import StageShapes
from planner.intra.ilp import solve_unconstrained
from planner.intra.incumbents import megatron_choice
from planner.intra.problem import evaluate
from planner.intra.stage_problem import IntraOpOptions, build_stage_problem
from planner.ir.graph import subgraph
from planner.ir.layers import graph_layers
from planner.sharding.specs import StageMesh

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt.py"
TINY = {"size": "tiny", "layers": 6}


def _prepare(nodes: int, per_node: int, *, batch_size: int = 16, **options: object):
    cluster = load_cluster("dgx-a100", num_nodes=nodes, devices_per_node=per_node)
    return prepare_model_file(GPT, cluster, batch_size=batch_size, model_args=TINY, **options)


class _Fresh(StageShapes):
    """Builds every stage problem again: what pricing did before stage shapes were shared."""

    def get(self, key: tuple, build):  # type: ignore[override]
        self.num_built += 1
        return build()


@pytest.mark.parametrize("method", ["megatron", "uniform-pipeline"])
def test_a_method_run_alone_is_the_candidate_auto_prices(method: str) -> None:
    """Only its own tables, same plan: the estimate and every stage equal auto's candidate of that method."""
    prepared = _prepare(2, 4)
    alone = plan_prepared(prepared, method)
    from planner.methods import search_auto

    result = search_auto(prepared).result
    assert result.priced[method].estimate == alone.estimate
    assert result.priced[method].stages == alone.stages


def test_reused_stage_shapes_price_like_fresh_problems(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same plan JSON whether stage problems are shared by shape or built for every stage."""
    degrees = (2, 2, 2)
    shared = plan_prepared(_prepare(2, 4, degrees=degrees), "megatron")
    monkeypatch.setattr("planner.baselines.handwritten_plan.StageShapes", _Fresh)
    fresh = plan_prepared(_prepare(2, 4, degrees=degrees), "megatron")
    assert shared.to_json()["stages"] == fresh.to_json()["stages"]
    assert shared.estimate == fresh.estimate


@pytest.mark.parametrize(
    ("submesh", "shape", "offsets"),
    [
        (Submesh(num_nodes=1, devices_per_node=2), (2,), (2, 4, 6)),
        (Submesh(num_nodes=1, devices_per_node=4), (2, 2), (4,)),
        (Submesh(num_nodes=2, devices_per_node=4), (4, 2), (8,)),
    ],
)
def test_a_stage_costs_the_same_wherever_its_devices_are_numbered(
    submesh: Submesh, shape: tuple[int, ...], offsets: tuple[int, ...]
) -> None:
    """Aligned placements see the same links: canonical ranks price like the stage's real ranks."""
    prepared = _prepare(4, 4)
    graph, setup = prepared.graph, prepared.setup
    names = [name for layer in graph_layers(graph)[1:3] for name in layer]
    part, options = subgraph(graph, names), IntraOpOptions(num_microbatches=2)
    canonical = build_stage_problem(part, setup, canonical_mesh(setup, submesh, shape), options)
    choices = [megatron_choice(canonical), solve_unconstrained(canonical.problem).choice]
    for offset in offsets:
        mesh = StageMesh(
            cluster=setup.cluster,
            devices=tuple(range(offset, offset + submesh.size)),
            mesh_shape=shape,
            activation_itemsize=setup.activation_itemsize,
        )
        placed = build_stage_problem(part, setup, mesh, options)
        for choice in choices:
            if choice is not None:
                assert evaluate(placed.problem, choice) == evaluate(canonical.problem, choice)


def test_a_fixed_configuration_is_the_same_plan_on_renumbered_nodes() -> None:
    """The same (t, p, d) on 2 nodes of 4 and 4 nodes of 2 where its stages see the same links: one estimate."""
    wide = plan_prepared(_prepare(2, 4, degrees=(2, 2, 2)), "megatron")
    again = plan_prepared(_prepare(2, 4, degrees=(2, 2, 2)), "megatron")
    assert wide.estimate == again.estimate
    devices = [stage.devices for stage in wide.stages]
    assert devices == [tuple(range(4)), tuple(range(4, 8))]


def test_microbatch_counts_reach_one_row_per_replica_with_fixed_degrees() -> None:
    assert microbatch_counts(3072, None) == [1, 2, 4, 8, 16, 32, 64]
    assert microbatch_counts(3072, None, data_degree=6) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert microbatch_counts(256, None, data_degree=2) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert microbatch_counts(256, None, data_degree=8) == [1, 2, 4, 8, 16, 32, 64]  # up to 64 as without degrees


def test_equal_spans_add_megatrons_cut_on_deep_models() -> None:
    deep = (0, *([1] * 40), 41)  # embedding, 40 blocks, head: past MAX_LAYERS
    by_layers, megatron = equal_spans(deep, 4)
    assert by_layers == [(0, 9), (10, 20), (21, 31), (32, 41)]  # equal layer counts over all 42 (10.5 each, rounded)
    assert megatron == [(0, 10), (11, 20), (21, 30), (31, 41)]  # 10 blocks each, embedding and head at the ends
    assert equal_spans((0, *([1] * 8), 9), 4) == [[(0, 1), (2, 4), (5, 7), (8, 9)]]  # grouped sizes: as before
    assert equal_spans((0, 1, 2), 2) == [[(0, 1), (2, 2)]]


@pytest.mark.slow
def test_the_second_capture_in_a_child_gives_the_same_graphs() -> None:
    one = _prepare(1, 4, batch_size=16, jobs=1)
    two = _prepare(1, 4, batch_size=16, jobs=2)
    for size in (16, 8, 4, 1):
        assert one.graphs.at(size) == two.graphs.at(size)
    assert two.graphs.num_captures == 2


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_exits_cleanly_without_a_plan_file(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    command = [
        sys.executable,
        "-m",
        "planner",
        str(GPT),
        "--cluster",
        "dgx-a100",
        "--nodes",
        "8",
        "--batch-size",
        "256",
        "--model-arg",
        "size=350m",
        "--jobs",
        "2",
        "--out",
        str(out),
    ]
    # a shell's background job (`cmd &` without job control) inherits SIGINT ignored: the plan then rightly
    # ignores Ctrl-C too, so the child gets the terminal's default disposition back
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )
    time.sleep(6)  # imports, then the two exports
    os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "plan: interrupted"
    assert "Traceback" not in stderr
    assert not out.exists()


@pytest.mark.slow
def test_more_jobs_give_the_same_auto_plan() -> None:
    """Layer tables and the counts' stage DPs over forked processes: the same plan as one process."""
    one = plan_prepared(_prepare(2, 4, batch_size=32, jobs=1), "auto")
    two = plan_prepared(_prepare(2, 4, batch_size=32, jobs=2), "auto")
    assert one.estimate == two.estimate
    assert one.to_json()["stages"] == two.to_json()["stages"]


def test_state_bound_prunes_only_points_that_cannot_fit() -> None:
    setup = _prepare(1, 4).setup
    budget = setup.memory_budget_bytes
    params = int(budget / 16 * 8)  # adam-mixed: 16 B per parameter, so 8 devices' worth of state
    assert state_can_fit(setup, params, (4, 2, 1), zero=0)
    assert not state_can_fit(setup, params, (4, 1, 2), zero=0)  # 4 shards hold twice a device
    assert not state_can_fit(setup, params, (4, 1, 2), zero=1)  # 2 + 2 + 12/2 B per parameter: still over
    assert state_can_fit(setup, params, (4, 1, 4), zero=1)  # 2 + 2 + 12/4: ZeRO-1 splits the Adam state over d
    assert state_can_fit(setup, params, (4, 1, 2), zero=3)  # 16/2 B per parameter: everything split over d too


def test_megatron_on_a_large_cluster_is_never_behind_a_point_it_tries() -> None:
    """Past 32 nodes the grid runs as megatron_at_scale: its plan is at least as fast as each (t, p, d) alone.
    Under 1F1B: the interleaved schedule is tried on the grid's three best candidates, not on every point's."""
    grid = plan_prepared(_prepare(34, 2, batch_size=68, schedule="1f1b"), "megatron")
    for degrees in ((2, 1, 34), (1, 2, 34), (2, 2, 17)):
        alone = plan_prepared(_prepare(34, 2, batch_size=68, degrees=degrees, schedule="1f1b"), "megatron")
        assert grid.estimate.step_time_s <= alone.estimate.step_time_s * (1 + 1e-12)
