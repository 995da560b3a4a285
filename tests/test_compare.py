"""Every method's plan validates and is judged by the simulator; ``plan compare`` end to end."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from cost_models.cluster import load_cluster
from planner.api import METHODS, plan_prepared, prepare_model_file
from planner.cli.main import main
from planner.compare import GAP_LIMIT, compare
from planner.errors import AutoplanError
from planner.plan import Plan, validate_plan
from tests.conftest import EXAMPLES

GPT = str(EXAMPLES / "gpt.py")


@functools.cache
def prepared_gpt(nodes: int = 1, per_node: int = 4, batch_size: int = 8):
    cluster = load_cluster("p3.16xlarge", num_nodes=nodes, devices_per_node=per_node)
    return prepare_model_file(GPT, cluster, batch_size=batch_size, model_args={"size": "tiny"}, rl_budget_s=3)


@functools.cache
def gpt_rows():
    return compare(prepared_gpt())


def test_every_method_returns_a_valid_plan_that_round_trips_and_simulates() -> None:
    prepared = prepared_gpt()
    rows = {row.method: row for row in gpt_rows()}
    assert set(rows) == set(METHODS)
    for method, row in rows.items():
        assert row.plan is not None, f"{method}: {row.note}"
        validate_plan(row.plan, prepared.graph)
        assert Plan.from_json(json.loads(row.plan.dumps())) == row.plan
        assert row.plan.method == method and row.step_time_s > 0
        assert row.fits, f"{method}: {row.note}"


def test_placement_plans_are_one_replicated_stage_per_device_under_dataflow() -> None:
    for row in gpt_rows():
        if row.method in ("hash", "critical-path", "multi-objective", "m-etf", "rl"):
            plan = row.plan
            assert plan.schedule == "dataflow" and plan.num_microbatches == 4
            assert all(stage.mesh_shape == (1,) and len(stage.devices) == 1 for stage in plan.stages)
            assert all(set(spec) == {"R"} for stage in plan.stages for spec in stage.output_specs.values())


def test_auto_is_at_least_as_fast_as_every_method_by_the_estimate_it_prints() -> None:
    rows = gpt_rows()
    auto = next(row for row in rows if row.method == "auto")
    for row in rows:
        if row.fits:
            assert auto.step_time_s <= row.step_time_s * (1 + 1e-9), row.method


@pytest.mark.parametrize(
    ("example", "args", "batch_size", "cluster", "nodes"),
    [
        ("gpt", {"size": "350m"}, 32, "p3.16xlarge", 2),  # GPT-tiny at the same shape: the same plans, 75 s more CI
        ("mlp", {}, 512, "dgx-a100", 1),
        ("resnet", {}, 256, "p3.16xlarge", 1),
        ("moe", {}, 64, "p3.16xlarge", 1),
    ],
)
def test_simulator_agrees_with_the_estimate_or_says_why(example, args, batch_size, cluster, nodes) -> None:
    """The replay agrees with each plan's estimate within GAP_LIMIT, or the row says why."""
    prepared = prepare_model_file(
        EXAMPLES / f"{example}.py", load_cluster(cluster, num_nodes=nodes), batch_size=batch_size, model_args=args
    )
    for row in compare(prepared, ("auto", "megatron", "uniform-pipeline", "data-parallel")):
        if row.plan is None:
            continue
        assert row.step_time_s == row.plan.estimate.step_time_s
        agrees = row.simulated_step_time_s == pytest.approx(row.step_time_s, rel=GAP_LIMIT)
        assert agrees or "simulated" in row.note, (row.method, row.note)
        assert (row.note == "") == agrees
        assert row.simulated_memory_bytes <= row.memory_per_device_bytes * 1.01 + 1, row.method


def test_degrees_evaluate_one_megatron_configuration() -> None:
    prepared = prepare_model_file(
        GPT,
        load_cluster("p3.16xlarge", num_nodes=1, devices_per_node=8),
        batch_size=16,
        model_args={"size": "tiny"},
        degrees=(2, 2, 2),
    )
    plan = plan_prepared(prepared, "megatron")
    assert len(plan.stages) == 2
    assert all(len(stage.devices) == 4 and stage.mesh_shape == (2, 2) for stage in plan.stages)
    with pytest.raises(AutoplanError, match="uses 12 devices, the cluster has 8"):
        prepare_model_file(GPT, load_cluster("p3.16xlarge"), batch_size=16, degrees=(2, 3, 2))
    with pytest.raises(AutoplanError, match="tensor degree 3 must divide"):
        prepare_model_file(GPT, load_cluster("p3.16xlarge", num_nodes=3), batch_size=16, degrees=(3, 8, 1))


def test_cli_compare_json_and_figure(tmp_path: Path, capsys) -> None:
    figure = tmp_path / "compare.png"
    args = [
        GPT,
        "--cluster",
        "p3.16xlarge",
        "--devices-per-node",
        "2",
        "--batch-size",
        "4",
        "--methods",
        "auto,data-parallel,hash,critical-path",
        "--json",
        "--figure",
        str(figure),
    ]
    assert main(["compare", *args]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["method"] for row in rows] == ["auto", "data-parallel", "hash", "critical-path"]
    for row in rows:
        assert {"method", "step_time_s", "memory_per_device_bytes", "fits", "search_time_s"} <= set(row)
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_compare_table(capsys) -> None:
    args = [GPT, "--cluster", "p3.16xlarge", "--devices-per-node", "2", "--batch-size", "4", "--methods", "auto,m-etf"]
    assert main(["compare", *args]) == 0
    out = capsys.readouterr().out
    assert "step s" in out and "simulated s" in out and "m-etf" in out and "auto" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--methods", "auto,nonsense"], "unknown method 'nonsense'"),
        (["--degrees", "2,2"], "three positive integers"),
        (["--figure", "/nowhere/x.png"], "directory /nowhere does not exist"),
        (["--figure", "x.svg"], "must name a .png file"),
        (["--rl-budget-s", "0"], "--rl-budget-s must be positive"),
        (["--rl-iterations", "0"], "--rl-iterations must be at least 1"),
    ],
)
def test_cli_compare_bad_input_is_one_line(extra, message, capsys) -> None:
    args = [GPT, "--cluster", "p3.16xlarge", "--devices-per-node", "2", "--batch-size", "4", *extra]
    try:
        code = main(["compare", *args])
    except SystemExit as exit_:  # argparse usage errors
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_cli_compare_refuses_a_directory_as_figure_before_planning(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "out.png"
    folder.mkdir()
    args = [GPT, "--cluster", "p3.16xlarge", "--devices-per-node", "2", "--batch-size", "4", "--figure", str(folder)]
    assert main(["compare", *args]) == 2
    assert capsys.readouterr().err == f"plan: error: --figure {folder} is a directory: name a .png file\n"


def test_rl_with_a_fixed_number_of_updates_gives_the_same_plan(tmp_path: Path) -> None:
    args = [
        GPT,
        "--cluster",
        "p3.16xlarge",
        "--devices-per-node",
        "2",
        "--batch-size",
        "4",
        "--method",
        "rl",
        "--rl-iterations",
        "20",
        "--rl-budget-s",
        "1e-9",
        "--seed",
        "5",
    ]
    plans = []
    for k in range(2):
        out = tmp_path / f"rl{k}.json"
        assert main([*args, "--out", str(out)]) == 0
        plans.append(json.loads(out.read_text()))
    assert plans[0]["stages"] == plans[1]["stages"]
    assert any("rl: 20 iterations" in note for note in plans[0]["notes"])


def test_plan_with_a_placement_method(tmp_path: Path, capsys) -> None:
    out = tmp_path / "hash.json"
    args = [GPT, "--cluster", "p3.16xlarge", "--devices-per-node", "2", "--batch-size", "4", "--method", "hash"]
    assert main([*args, "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["method"] == "hash" and plan["schedule"] == "dataflow" and len(plan["stages"]) == 2
