"""CPU offload under FSDP2 (``--offload``, ``Stage.offload``): the host link, its price, the choice, the plan JSON,
the executors' CPUOffloadPolicy against one process (``-k offload_parity``), and a model that only fits with it."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from cost_models.cluster import load_cluster
from cost_models.memory import optimizer_bytes
from cost_models.units import GIB
from planner.api import plan_prepared, prepare_model_file
from planner.baselines.data_parallel import data_parallel_stage
from planner.baselines.method_options import method_option_refusal
from planner.cli.main import main
from planner.costing.ddp import fsdp_step
from planner.costing.offload import host_bytes, host_optimizer_s
from planner.costing.zero import fsdp_memory
from planner.errors import AutoplanError
from planner.options import PlanOptions
from planner.plan import Plan, save_plan
from planner.plan.choices import plan_choices
from tests.conftest import EXAMPLES, captured, setup_for, torchrun

BATCH = 8


def test_host_links_follow_the_pcie_generation_and_cpu_ranks_copy_in_memory() -> None:
    """PCIe 3.0 (V100), 4.0 (A100), 5.0 (H100) x16 at 80% pinned; a CPU rank's "copy" is a memcpy (half its
    streaming bandwidth), its optimizer streams at the rank's own bandwidth."""
    assert load_cluster("p3.16xlarge").host().bandwidth == pytest.approx(0.8 * 15.75e9)
    assert load_cluster("dgx-a100").host().bandwidth == pytest.approx(0.8 * 31.5e9)
    assert load_cluster("dgx-h100").host().bandwidth == pytest.approx(0.8 * 63e9)
    a100 = load_cluster("dgx-a100").host()
    assert a100.per_device_memory_bandwidth == pytest.approx(0.75 * 2 * 8 * 3200e6 * 8 / 8)
    cpu = load_cluster("local-cpu")
    streaming = cpu.device.memory_bandwidth * cpu.device.memory_efficiency
    assert cpu.host().bandwidth == pytest.approx(streaming / 2)
    assert cpu.host().per_device_memory_bandwidth == pytest.approx(streaming)
    assert load_cluster("p3.16xlarge").host().host_memory_bytes == 488 * GIB
    assert load_cluster("dgx-h100").host().host_memory_bytes == 2e12


def test_offload_on_cpu_ranks_saves_no_memory_and_the_host_must_hold_every_shard() -> None:
    """A CPU rank's host is its own memory: its offloaded plan holds what the plan without offload holds. The
    node's DRAM holds each device's shards, N·(w + g + s)/d, for the node's devices."""
    graph = captured("gpt", BATCH)
    cpu = setup_for(cluster=load_cluster("local-cpu", num_nodes=1, devices_per_node=2))
    stage = replace(data_parallel_stage(graph, cpu, batch_size=BATCH, devices=(0, 1)), zero=3)
    offloaded = replace(stage, offload=True)
    assert fsdp_memory(offloaded, graph, cpu).total_bytes == fsdp_memory(stage, graph, cpu).total_bytes
    a100 = setup_for()
    stage = replace(data_parallel_stage(graph, a100, batch_size=BATCH, devices=tuple(range(8))), zero=3, offload=True)
    per = optimizer_bytes(a100.optimizer)
    assert host_bytes(stage, graph, a100) == pytest.approx(graph.num_params * (per.weights + per.grads + per.state))


@pytest.mark.parametrize("level", [1, 2, 3])
def test_offload_moves_the_shards_off_the_device_and_prices_copies_and_the_cpu_step(level: int) -> None:
    """Per device: the weight and optimizer-state shards (and at levels 2, 3 the gradient shards) leave the
    device; the step pays the copies over PCIe and Adam on the CPU instead of on the device."""
    graph, setup = captured("gpt", BATCH), setup_for()
    stage = replace(data_parallel_stage(graph, setup, batch_size=BATCH, devices=tuple(range(8))), zero=level)
    offloaded = replace(stage, offload=True)
    kept, moved = fsdp_memory(stage, graph, setup), fsdp_memory(offloaded, graph, setup)
    per, n = optimizer_bytes(setup.optimizer), graph.num_params
    shards = n * (per.weights / (8 if level == 3 else 1) + per.state / 8)
    assert kept.state_bytes == pytest.approx(shards)  # one microbatch: the gradients are in the tape
    assert moved.state_bytes == 0
    assert moved.total_bytes < kept.total_bytes
    if level >= 2:  # the gradient shards too: they leave the tape
        assert kept.total_bytes - moved.total_bytes > shards
    before, after = fsdp_step(stage, graph, setup, m=1), fsdp_step(offloaded, graph, setup, m=1)
    host = host_optimizer_s(offloaded, graph, setup)
    expected = n / 8 * (2 * (per.weights + per.state) + per.grads) / setup.cluster.host().per_device_memory_bandwidth
    assert host == pytest.approx(expected)
    assert after.breakdown_s["host_optimizer_s"] == pytest.approx(host)
    assert "optimizer_s" not in after.breakdown_s and "host_optimizer_s" not in before.breakdown_s
    assert after.step_s > before.step_s  # offload never saves time
    assert after.whole_sync_s > before.whole_sync_s  # the copies ride with the collectives


def test_offload_options_are_checked_in_one_line() -> None:
    with pytest.raises(AutoplanError, match="--offload must be one of auto, off, on"):
        PlanOptions(offload="always")
    with pytest.raises(AutoplanError, match="--offload on runs under FSDP"):
        PlanOptions(offload="on", zero="0")
    refusal = method_option_refusal("megatron", PlanOptions(offload="on"))
    assert refusal is not None and "data-parallel plans only" in refusal
    assert method_option_refusal("data-parallel", PlanOptions(offload="on")) is None
    assert "CPU offload" in PlanOptions(offload="on").asked_choices()


def _offloaded_mlp_plan(world: int = 2) -> Plan:
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=world)
    prepared = prepare_model_file(EXAMPLES / "mlp.py", cluster, batch_size=16, zero="3", offload="on")
    return plan_prepared(prepared, "data-parallel")


def test_offload_on_plans_it_and_the_json_round_trips_and_old_plans_load_without_it() -> None:
    plan = _offloaded_mlp_plan()
    (stage,) = plan.stages
    assert stage.offload and stage.zero == 3
    assert "CPU offload" in stage.memory_saving.choice and stage.memory_saving.saved_s < 0
    assert "host_optimizer_s" in plan.estimate.breakdown_s
    assert plan_choices(plan).stages[0].zero == "ZeRO-3, CPU offload"  # plan explain's choices
    data = plan.to_json()
    assert data["stages"][0]["offload"] is True
    assert Plan.from_json(data) == plan
    del data["stages"][0]["offload"]  # a plan written before offload existed
    data["stages"][0]["memory_saving"] = None
    assert Plan.from_json(data).stages[0].offload is False


def test_offload_parity(tmp_path: Path) -> None:
    """ZeRO-3 with FSDP2's CPUOffloadPolicy on 2 gloo ranks against one process: the loss and every gradient of
    two AdamW steps, and the optimizer state after them, by relative norm (on CPU ranks the policy runs, its
    copies no-ops: host and device are the same memory)."""
    path = tmp_path / "mlp-fsdp3-offload.json"
    save_plan(_offloaded_mlp_plan(), path)
    out = tmp_path / "report.json"
    done = torchrun(2, "offload_worker.py", out, [path])
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["offloaded"], "the stage did not run under CPUOffloadPolicy"
    assert all(step["ok"] for step in report["steps"]), report["steps"]
    assert report["state"] and all(
        excess <= 0 for moments in report["state"].values() for excess in moments.values()
    ), report["state"]


def test_a_model_whose_state_only_fits_offloaded_is_planned_with_offload(tmp_path: Path, capsys) -> None:
    """GPT-2.6B on 2 V100 16 GB: Adam's state alone is 21 GiB per device split over both, so no plan fits without
    offload; auto picks ZeRO with CPU offload and says what it saved and cost. ``--offload off`` does not fit, and
    the error says that offload would."""
    args = [
        str(EXAMPLES / "gpt.py"),
        *("--cluster", "p3.16xlarge", "--devices-per-node", "2", "--batch-size", "2", "--model-arg", "size=2.6b"),
    ]
    assert main([*args, "--out", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "sharded over the data axes; their shards in host memory, the optimizer on the CPU" in out
    line = next(line for line in out.splitlines() if "memory:" in line)
    assert ", CPU offload:" in line and "s more per step and" in line and "(does not fit)" in line
    assert "host optimizer" in out
    plan = Plan.from_json(json.loads((tmp_path / "plan.json").read_text()))
    (stage,) = plan.stages
    assert stage.offload and stage.zero >= 1
    assert plan.estimate.memory_per_device_bytes <= plan.cluster.device.memory_bytes
    assert math.isfinite(plan.estimate.step_time_s)
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main([*args, "--offload", "off", "--out", str(tmp_path / "off.json")]))
    assert exit_info.value.code == 2
    assert not (tmp_path / "off.json").exists()
    error = capsys.readouterr().err
    assert "does not fit" in error and "CPU offload fits it (ZeRO-" in error and "drop --offload off" in error


@pytest.mark.parametrize("zero", ["1", "3", "auto"])
def test_an_offloaded_plan_has_one_price_in_the_estimate_and_the_simulator(zero: str) -> None:
    """The copies ride on FSDP's collectives and the CPU step replaces the device's, in the simulator as in the
    estimate: the simulated step equals the estimate."""
    from planner.costing.lowering import simulate_plan
    from planner.costing.setup import plan_setup

    cluster = load_cluster("dgx-a100", num_nodes=1, devices_per_node=4)
    prepared = prepare_model_file(EXAMPLES / "gpt.py", cluster, batch_size=8, zero=zero, offload="on")
    plan = plan_prepared(prepared, "data-parallel")
    (stage,) = plan.stages
    assert stage.offload and (stage.zero == int(zero) if zero != "auto" else stage.zero >= 1)
    simulated = simulate_plan(plan, captured("gpt", 8), plan_setup(plan))
    assert simulated.step_time_s == pytest.approx(plan.estimate.step_time_s, rel=1e-9)


def test_auto_with_offload_on_plans_only_the_offloaded_data_parallel_plan() -> None:
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    plan = plan_prepared(prepare_model_file(EXAMPLES / "mlp.py", cluster, batch_size=16, offload="on"), "auto")
    (stage,) = plan.stages
    assert stage.offload and stage.zero >= 1 and stage.is_pure_data_parallel
    fits = plan_prepared(prepare_model_file(EXAMPLES / "mlp.py", cluster, batch_size=16), "auto")
    assert not any(stage.offload for stage in fits.stages)  # auto: it fits without, so no offload
    assert plan.estimate.step_time_s > fits.estimate.step_time_s


def test_no_offloaded_plan_when_the_host_cannot_hold_the_shards(monkeypatch) -> None:
    import planner.baselines.offloaded as offloaded

    monkeypatch.setattr(offloaded, "host_bytes", lambda *args: math.inf)
    with pytest.raises(AutoplanError, match="cannot make a data-parallel plan with ZeRO-3, CPU offload"):
        _offloaded_mlp_plan()


def test_a_plan_that_offloads_without_fsdp_is_refused_by_validation() -> None:
    from planner.plan import PlanError, validate_plan

    plan = _offloaded_mlp_plan()
    graph = captured("mlp", 16)
    validate_plan(plan, graph)
    without_zero = replace(plan, stages=(replace(plan.stages[0], zero=0),))
    with pytest.raises(PlanError, match="CPU offload runs under FSDP"):
        validate_plan(without_zero, graph)


def test_auto_offloads_only_when_no_level_fits_without_it() -> None:
    """best_offloaded_level: a level that fits without offload means no offload under auto (only_if_needed), and
    the offloaded level's line against it under on; with none fitting, the line says the next best does not fit."""
    from planner.inter.data_parallel_levels import best_offloaded_level

    graph, setup = captured("gpt", BATCH), setup_for(memory_gib=1.0)
    stage = data_parallel_stage(graph, setup, batch_size=BATCH, devices=tuple(range(8)))
    budget = setup.memory_budget_bytes

    def step_at(level: int, offload: bool) -> float:
        return 1.0 + level / 10 + offload

    def price(fits_without: bool):
        def memory_at(level: int, offload: bool) -> float:
            return budget / 2 if offload or (fits_without and level == 3) else 2 * budget

        return {
            needed: best_offloaded_level(
                stage, setup, zero="auto", step_at=step_at, memory_at=memory_at, only_if_needed=needed
            )
            for needed in (True, False)
        }

    fits = price(fits_without=True)
    assert fits[True] is None
    chosen, line = fits[False]
    assert chosen.offload and chosen.level == 1 and line.next_best == "no recomputation, ZeRO-3"
    chosen, line = price(fits_without=False)[True]
    assert chosen.offload and line.choice == "no recomputation, ZeRO-1, CPU offload"
    assert line.next_best.endswith("(does not fit)") and line.saved_s < 0
