"""Which choices each stage uses and what each saved (planner.plan.choices), printed by ``plan --explain`` and
``plan show``: sequence parallelism re-priced here on its own, recomputation and ZeRO, the schedule, a lossy
gradient sync, one-device stages without a ZeRO comparison, and plans stored before the savings were."""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import re

import pytest

from cost_models.cluster import load_cluster
from cost_models.collective_algorithms import choose_all_reduce
from cost_models.communication import DDP_BUCKET_BYTES
from planner.api import plan_model_file
from planner.cli.choices_table import choices_text
from planner.cli.explain_table import explain_table
from planner.cli.main import main
from planner.costing.records import record_of
from planner.costing.setup import plan_setup
from planner.intra.ilp import solve_strategy_ilp, solve_unconstrained
from planner.intra.incumbents import megatron_choice
from planner.intra.problem import evaluate
from planner.intra.stage_problem import IntraOpOptions, build_stage_problem
from planner.plan import MemorySaving, Plan, Remat
from planner.plan.choices import EXACT_SYNC, memory_saving_of, plan_choices
from planner.plan.report import plan_summary
from planner.sharding.sequence_parallel import is_sequence_parallel
from planner.sharding.specs import StageMesh
from tests.conftest import EXAMPLES, captured

MEGATRON_SP = ["--cluster", "dgx-a100", "--batch-size", "8", "--method", "megatron", "--degrees", "2,1,4"]


@functools.cache
def megatron_plan() -> Plan:
    """GPT tiny, tensor 2 × data 4 on one DGX A100, one stage, one microbatch: Megatron with sequence parallelism."""
    return plan_model_file(
        EXAMPLES / "gpt.py", load_cluster("dgx-a100", num_nodes=1), batch_size=8, method="megatron", degrees=(2, 1, 4)
    )


def test_a_sequence_parallel_stage_says_what_it_saved_as_an_independent_re_pricing_finds() -> None:
    """Re-priced here: the stage problem with and without sequence-parallel strategies, the stored strategies
    found among the first, the next best by the ILP (not the elimination the planner uses) over the second with
    every node that is not sequence parallel kept. One microbatch, one stage: seconds = objective, bytes =
    the problem's memory (state + kept activations, one microbatch in flight)."""
    plan = megatron_plan()
    stage = plan.stages[0]
    assert plan.num_microbatches == 1 and stage.uses_sequence_parallelism
    setup, graph = plan_setup(plan), captured("gpt", 8)
    mesh = StageMesh(
        cluster=setup.cluster,
        devices=stage.devices,
        mesh_shape=stage.mesh_shape,
        activation_itemsize=setup.activation_itemsize,
    )
    with_sp = build_stage_problem(graph, setup, mesh)
    plain = build_stage_problem(graph, setup, mesh, IntraOpOptions(sequence_parallel=False))
    chosen = tuple(
        next(i for i, s in enumerate(with_sp.strategies[v]) if record_of(graph.node(name), s) == stage.strategies[name])
        for v, name in enumerate(with_sp.variables)
    )
    sequence = [v for v, c in enumerate(chosen) if is_sequence_parallel(with_sp.strategies[v][c])]
    assert sequence, "some nodes use sequence-parallel strategies"
    # a kept node's other strategies cost 1 s, far above any step here: a larger penalty (1e3) spreads the costs over
    # eight decades, and HiGHS then stops at a worse point it calls optimal (found once host dispatch made many ties)
    costs = tuple(
        row
        if v in sequence
        else tuple(
            c if s == with_sp.strategies[v][chosen[v]] else 1.0 for s, c in zip(plain.strategies[v], row, strict=True)
        )
        for v, row in enumerate(plain.problem.node_costs)
    )
    pinned = dataclasses.replace(plain.problem, node_costs=costs, memory_budget=None)
    other = solve_strategy_ilp(pinned, time_limit_s=20).choice
    chosen_s, other_s = evaluate(with_sp.problem, chosen)[0], evaluate(plain.problem, other)[0]
    saving = stage.sequence_parallel_saving
    # the planner's next best (exact elimination) is the ILP's optimum, up to the solver's relative MIP gap (1e-4)
    assert chosen_s + saving.saved_s == pytest.approx(other_s, rel=1e-4)
    assert chosen_s + saving.saved_s <= other_s * (1 + 1e-12)  # (several next bests may tie: bytes not compared)
    assert saving.saved_s > 0 and saving.saved_bytes > 0  # faster and smaller, as Korthikanti et al. find
    best_plain = solve_unconstrained(plain.problem).objective  # no stage without sequence parallelism is faster
    keep_rest = tuple(
        c if v not in sequence else megatron_choice(plain, sequence_parallel=False)[v] for v, c in enumerate(chosen)
    )
    assert best_plain - chosen_s <= saving.saved_s <= evaluate(plain.problem, keep_rest)[0] - chosen_s
    row = plan_choices(plan).stages[0]
    assert row.sequence_parallel and [s.kind for s in row.savings][-1] == "sequence parallel"
    assert "saved: sequence parallel: " in choices_text(plan_choices(plan))


def test_forced_recomputation_and_zero_show_what_they_saved() -> None:
    cluster = load_cluster("dgx-a100", num_nodes=1, devices_per_node=4)
    plan = plan_model_file(
        EXAMPLES / "gpt.py",
        cluster,
        batch_size=8,
        model_args={"attention": "unfused"},
        method="megatron",
        degrees=(2, 1, 2),
        remat="attention",
        zero=1,
        microbatches=2,
    )
    stage = plan.stages[0]
    assert stage.remat == "attention" and stage.zero == 1
    row = plan_choices(plan).stages[0]
    assert (row.recomputation, row.zero, row.grad_sync) == ("selective (attention)", "ZeRO-1", EXACT_SYNC)
    memory = next(s for s in row.savings if s.kind == "recomputation and ZeRO")
    stored = stage.memory_saving
    assert memory.choice == "selective recomputation (attention), ZeRO-1" == stored.choice
    assert (memory.saved_s, memory.saved_bytes, memory.next_best) == (
        stored.saved_s,
        stored.saved_bytes,
        stored.next_best,
    )
    assert memory.next_best != memory.choice and (memory.saved_s, memory.saved_bytes) != (0, 0)
    assert "saved: recomputation and ZeRO (selective recomputation (attention), ZeRO-1)" in choices_text(
        plan_choices(plan)
    )


def test_one_device_stages_compare_no_zero_levels() -> None:
    """ZeRO on one device shards nothing: it is no alternative, and a hand-edited plan's comparison with it is
    dropped."""
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    plan = plan_model_file(
        EXAMPLES / "gpt.py",
        cluster,
        batch_size=8,
        model_args={"attention": "unfused"},
        method="megatron",
        degrees=(1, 2, 1),
        microbatches=2,
        schedule="gpipe",
    )
    assert all(len(stage.devices) == 1 for stage in plan.stages)
    for stage in plan.stages:
        assert stage.memory_saving is None or "ZeRO-" not in stage.memory_saving.next_best
    bogus = MemorySaving(
        choice="no recomputation, no ZeRO",
        next_best="no recomputation, ZeRO-1",
        saved_s=0.0,
        saved_bytes=0.0,
        next_best_remat=Remat.NONE,
        next_best_zero=1,
    )
    old = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, memory_saving=bogus) for s in plan.stages))
    assert memory_saving_of(old.stages[0]) is None
    assert "memory:" not in plan_summary(old) and "ZeRO-1" not in choices_text(plan_choices(old))


def test_an_interleaved_plan_says_what_its_schedule_saved_as_its_note_does() -> None:
    plan = plan_model_file(
        EXAMPLES / "gpt.py",
        load_cluster("dgx-a100", num_nodes=1),
        batch_size=32,
        model_args={"layers": 8},
        method="megatron",
        degrees=(2, 2, 2),
        microbatches=8,
        schedule="interleaved",
    )
    assert plan.schedule == "interleaved" and len(plan.stages) > 2
    (schedule,) = plan_choices(plan).plan_savings
    note = next(n for n in plan.notes if n.startswith("schedule interleaved"))
    said_ms = float(re.search(r"saves (\S+) ms per step", note).group(1))
    assert schedule.saved_s * 1e3 == pytest.approx(said_ms, rel=5e-3)
    assert schedule.choice == f"interleaved, {len(plan.stages) // 2} virtual stages per rank"
    assert "schedule saved bytes" not in plan_summary(plan) and "whole plan:" in choices_text(plan_choices(plan))


def test_a_lossy_gradient_sync_says_what_it_saved_against_exact() -> None:
    plan = plan_model_file(
        EXAMPLES / "gpt.py",
        load_cluster("p3.16xlarge", num_nodes=2),
        batch_size=16,
        method="megatron",
        degrees=(8, 1, 2),
        optimizer="adam-fp32",
        allow_lossy=True,
        grad_sync="bf16",
    )
    (sync,) = plan_choices(plan).plan_savings
    assert (sync.choice, sync.next_best, sync.saved_bytes) == ("bf16", "exact", None)
    assert sync.saved_s == plan.estimate.savings.grad_sync_saved_s
    assert all(row.grad_sync == "bf16" for row in plan_choices(plan).stages)


def test_plan_explain_and_plan_show_print_the_table(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    assert main([str(EXAMPLES / "gpt.py"), *MEGATRON_SP, "--out", str(out), "--explain"]) == 0
    explained = capsys.readouterr().out
    assert "choices per stage" in explained and "sequence parallel" in explained and "split per mesh axis" in explained
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "choices per stage" in shown and "saved: sequence parallel: " in shown
    assert main(["show", str(out), "--json"]) == 0
    choices = json.loads(capsys.readouterr().out)["choices"]
    assert choices["stages"][0]["sequence_parallel"] and choices["stages"][0]["savings"][-1]["saved_s"] > 0


def test_a_plan_without_the_savings_loads_and_explains() -> None:
    data = megatron_plan().to_json()
    for stage in data["stages"]:
        del stage["sequence_parallel_saving"]
    old = Plan.from_json(data)
    assert old.stages[0].sequence_parallel_saving is None and old.stages[0].uses_sequence_parallelism
    row = plan_choices(old).stages[0]
    assert row.sequence_parallel and all(s.kind != "sequence parallel" for s in row.savings)
    assert Plan.from_json(megatron_plan().to_json()) == megatron_plan()


def test_the_explanation_names_each_all_reduce_s_algorithm() -> None:
    """GPT tiny, tensor 2 × data 8 on two DGX A100s: a row-split matmul's partial sum is all-reduced over its 2
    tensor-parallel devices on one node (a ring), a parameter's gradient over the 8 data-parallel replicas on two
    nodes, in the algorithm the chooser picks for a DDP bucket over that group; ``plan --explain`` prints them."""
    cluster = load_cluster("dgx-a100", num_nodes=2)
    plan = plan_model_file(EXAMPLES / "gpt.py", cluster, batch_size=16, method="megatron", degrees=(2, 1, 8))
    stage = plan.stages[0]
    data_axis = next(axis for axis, size in enumerate(stage.mesh_shape) if size == 8)
    mesh = StageMesh(cluster=cluster, devices=stage.devices, mesh_shape=stage.mesh_shape)
    bucket = choose_all_reduce(DDP_BUCKET_BYTES, num_devices=8, link=mesh.link(data_axis)).algorithm
    words = " ".join(row.all_reduces for row in stage.explanation)
    assert f"gradient sync all-reduce 25.0 MiB over 8 devices on 2 nodes: {bucket}" in words
    assert re.search(r"(forward|backward) all-reduce [0-9.]+ [KM]iB over 2 devices: ring", words)
    assert "all-reduce algorithms" in explain_table_text(list(stage.explanation))


def explain_table_text(rows: list) -> str:
    from rich.console import Console

    console = Console(width=300, record=True, file=io.StringIO())
    console.print(explain_table(rows, title="stage 0"))
    return console.export_text()
