"""Runtime profiles (--runtime): a published system's gradient sync and optimizer, priced as it ran, the estimate
and the simulator alike; what a plan made under one says, and that plan run refuses it."""

from __future__ import annotations

import dataclasses

import pytest

from cost_models.cluster import load_cluster, preset
from cost_models.compute import RooflineCompute
from planner.api import plan_model_file
from planner.costing.estimate import optimizer_step_s
from planner.costing.lowering import lower_plan, simulate_lowered
from planner.costing.node_cost import autocast_cast_s, node_cost
from planner.costing.overlap import ddp_segments, exposed_sync_s
from planner.costing.plan_memory import sharded_stage_memory
from planner.costing.runtime_profiles import AUTOCAST_CAST_BYTES, AUTOPLAN, PROFILES, runtime_profile
from planner.costing.setup import CostSetup, plan_setup
from planner.errors import AutoplanError
from planner.inter.layer_costs import loss_and_output_bytes
from planner.ir.graph import NodeKind
from planner.plan import Plan
from planner.sharding.specs import StageMesh
from tests.conftest import EXAMPLES, by_name, captured, setup_for

MEGATRON = runtime_profile("megatron-lm-2021")


def test_megatron_syncs_one_buffer_after_the_backward() -> None:
    graph = captured("mlp", 8, "export", hidden=2048, layers=4)  # 4 x 16 MiB fp32 weights: several DDP buckets
    link = load_cluster("dgx-a100").intra_node
    backward = {node.name: 1e-3 for node in graph.nodes}
    ours = ddp_segments(graph, backward, optimizer="sgd", num_devices=8, link=link)
    theirs = ddp_segments(graph, backward, optimizer="sgd", num_devices=8, link=link, runtime=MEGATRON)
    buckets = [segment for segment in theirs if segment.all_reduce_s > 0]
    assert len(buckets) == 1 and len([s for s in ours if s.all_reduce_s > 0]) >= 3
    assert theirs[0].backward_s == pytest.approx(1e-3 * len(graph.nodes))  # ready when the whole backward is done
    assert exposed_sync_s(theirs) == pytest.approx(buckets[0].all_reduce_s)  # nothing hidden
    assert exposed_sync_s(theirs) > exposed_sync_s(ours)


# (degrees, how close the estimate and the simulation are): one stage (DDP, then a sharded stage) exactly; a pipeline's
# closed-form step differs from its replay under our runtime too (here 1.4%), and by about as much under Megatron's
@pytest.mark.parametrize(("degrees", "rel"), [((1, 1, 8), 1e-6), ((2, 1, 4), 1e-6), ((2, 2, 2), 0.03)])
def test_a_runtimes_estimate_and_its_simulation_agree(degrees: tuple[int, int, int], rel: float) -> None:
    """The profile is in the plan (plan_setup reads it back), so plan show's simulation prices the same sync."""
    args = {"size": "tiny", "attention": "unfused", "dropout": 0.1}
    plans = {
        runtime: plan_model_file(
            EXAMPLES / "gpt.py",
            load_cluster("dgx-a100"),
            batch_size=16,
            model_args=args,
            method="megatron",
            degrees=degrees,
            microbatches=2,
            schedule="1f1b",
            runtime=runtime,
        )
        for runtime in ("autoplan", "megatron-lm-2021")
    }
    theirs = plans["megatron-lm-2021"]
    assert theirs.runtime == "megatron-lm-2021" and plan_setup(theirs).runtime == MEGATRON
    graph = captured("gpt", 8, "export", **args)
    simulated = simulate_lowered(lower_plan(theirs, graph, plan_setup(theirs))).step_time_s
    assert simulated == pytest.approx(theirs.estimate.step_time_s, rel=rel)
    assert theirs.estimate.step_time_s != plans["autoplan"].estimate.step_time_s


def test_a_plan_under_another_runtime_says_so_and_keeps_it() -> None:
    plan = plan_model_file(
        EXAMPLES / "mlp.py", load_cluster("dgx-a100"), batch_size=64, method="data-parallel", runtime="megatron-lm-2019"
    )
    assert any(note.startswith("runtime megatron-lm-2019: the estimate describes") for note in plan.notes)
    assert any("all-reduced after its last backward (megatron-lm-2019)" in note for note in plan.notes)
    assert Plan.from_json(plan.to_json()).runtime == "megatron-lm-2019"
    ours = plan_model_file(EXAMPLES / "mlp.py", load_cluster("dgx-a100"), batch_size=64, method="data-parallel")
    assert ours.runtime == "autoplan" and not any(note.startswith("runtime ") for note in ours.notes)
    legacy = {key: value for key, value in ours.to_json().items() if key != "runtime"}  # plans stored before runtimes
    assert Plan.from_json(legacy).runtime == "autoplan"


def test_an_unknown_runtime_names_the_choices() -> None:
    with pytest.raises(AutoplanError, match="--runtime must be one of autoplan, megatron-lm-2019"):
        runtime_profile("megatron-lm-2030")
    assert AUTOPLAN.refusal(what="plan run") is None
    assert all(profile.refusal(what="plan run") for name, profile in PROFILES.items() if name != "autoplan")


def test_the_optimizer_step_is_the_runtimes_own_on_gpus_only() -> None:
    a100 = load_cluster("dgx-a100")
    device = a100.device
    setups = {
        runtime: CostSetup(
            cluster=a100,
            compute=RooflineCompute(device=device),
            optimizer="adam-mixed",
            runtime=runtime_profile(runtime),
        )
        for runtime in ("autoplan", "megatron-lm-2021")
    }
    bandwidth = device.memory_bandwidth * device.memory_efficiency
    params = 1e9
    # torch's single-tensor AdamW moves 72 B per parameter and our program's gradient norm 12 B more; Megatron's
    # fp16 optimizer with apex's FusedAdam 60 B
    assert optimizer_step_s(params, setups["autoplan"]) == pytest.approx((72 + 12) * params / bandwidth)
    assert optimizer_step_s(params, setups["megatron-lm-2021"]) == pytest.approx(60 * params / bandwidth)
    cpu = preset("local-cpu")  # CPU devices keep the formula their calibrated overheads were fitted with
    setup = CostSetup(cluster=cpu, compute=RooflineCompute(device=cpu.device), optimizer="adam-fp32")
    moved = params * (2 * (4 + 8) + 4)
    assert optimizer_step_s(params, setup) == pytest.approx(
        moved / (cpu.device.memory_bandwidth * cpu.device.memory_efficiency)
    )


def test_the_cli_refuses_to_run_or_compile_a_plan_of_another_runtime(tmp_path) -> None:
    from planner.cli.main import main

    cluster = dataclasses.replace(load_cluster("local-cpu"), num_nodes=1, devices_per_node=2)
    plan = plan_model_file(
        EXAMPLES / "mlp.py", cluster, batch_size=16, method="data-parallel", runtime="megatron-lm-2021"
    )
    path = tmp_path / "plan.json"
    path.write_text(plan.dumps())
    assert main(["run", str(path), "--steps", "1"]) == 2
    assert main(["compile", str(path), "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def two_devices(setup: CostSetup) -> StageMesh:
    return StageMesh(
        cluster=setup.cluster, devices=(0, 1), mesh_shape=(2,), activation_itemsize=setup.activation_itemsize
    )


def test_our_runtime_prices_autocasts_casts_of_matmul_parameters_per_pass() -> None:
    """fp32 parameters under bf16 autocast: each linear's weight and bias cast once per step (read 4 B, write 2;
    autocast's cache keeps the copy for every microbatch) and their gradients cast back in every microbatch's
    backward, at their local (sharded) size; Megatron keeps bf16 parameters, the CPU and fp32 runs cast nothing, and
    a norm's parameters stay fp32 under autocast."""
    graph = captured("gpt", 4, "export", size="tiny")
    linear = next(n for n in graph.nodes if n.kind == NodeKind.MATMUL and len(n.inputs) == 3)  # x, weight, bias
    norm = next(n for n in graph.nodes if n.kind == NodeKind.NORM)
    ours = setup_for()
    device = ours.cluster.device
    bandwidth = device.memory_bandwidth * device.memory_efficiency
    numel = sum(
        meta.numel for value, meta in zip(linear.inputs, linear.input_metas, strict=True) if value in graph.param_names
    )
    replicated, column = by_name(graph, linear.name, (2,))["-"], by_name(graph, linear.name, (2,))["n"]
    mesh = two_devices(ours)
    whole = numel * AUTOCAST_CAST_BYTES / bandwidth + 2 * device.kernel_overhead_s
    assert autocast_cast_s(linear, replicated, ours, mesh) == pytest.approx(whole)
    halves = numel / 2 * AUTOCAST_CAST_BYTES / bandwidth + 2 * device.kernel_overhead_s
    assert autocast_cast_s(linear, column, ours, mesh) == pytest.approx(halves)
    with_cast = node_cost(linear, replicated, ours, mesh, saved=True)
    no_casts = dataclasses.replace(ours, runtime=dataclasses.replace(AUTOPLAN, autocast_casts=False))
    without = node_cost(linear, replicated, no_casts, mesh, saved=True)  # the same optimizer bytes, no casts
    megatron = dataclasses.replace(ours, runtime=runtime_profile("megatron-lm-2021"))
    assert autocast_cast_s(linear, replicated, megatron, mesh) == 0.0  # Megatron keeps bf16 parameters
    # the backward's cast of the gradients every microbatch; the forward's once per step (autocast caches it)
    assert with_cast.compute_s - without.compute_s == pytest.approx(whole)
    assert with_cast.step_s - without.step_s == pytest.approx(whole)
    assert with_cast.forward_s == without.forward_s  # recomputation reuses the cached cast
    assert autocast_cast_s(linear, replicated, dataclasses.replace(ours, optimizer="adam-fp32"), mesh) == 0.0
    norm_strategy = next(iter(by_name(graph, norm.name, (2,)).values()))
    assert autocast_cast_s(norm, norm_strategy, ours, mesh) == 0.0
    cpu = preset("local-cpu")
    on_cpu = CostSetup(cluster=cpu, compute=RooflineCompute(device=cpu.device), optimizer="adam-mixed")
    assert autocast_cast_s(linear, replicated, on_cpu, two_devices(on_cpu)) == 0.0


def test_megatron_keeps_its_share_of_the_outputs_and_no_receive_buffers() -> None:
    """Megatron-LM keeps each rank's share of the logits (its replica's rows, the vocabulary split over tensor
    parallelism) and the loss on it, and allocates what a pipeline stage receives per microbatch; our executors
    gathered the outputs whole on every rank (still, where the outputs are not batch-major: ``whole`` here), and
    since 2026-11-28 run the loss on each rank's rows (planner.plan.stage.loss_row_axes: here a quarter, on 2 × 2
    ranks) and allocate what a stage receives per microbatch too (executors.parallel.receive_buffers). Charging
    Megatron for ours refused the published 76.1B-1T rows (88 GiB of whole logits and loss, 140 GiB of receive
    buffers per device). torch's stock stages keep a receive buffer per microbatch (``kept_receive_buffers``):
    charged as held memory."""
    args = {"size": "tiny", "attention": "unfused", "dropout": 0.1}
    theirs = plan_model_file(
        EXAMPLES / "gpt.py",
        load_cluster("dgx-a100"),
        batch_size=16,
        model_args=args,
        method="megatron",
        degrees=(2, 2, 2),
        microbatches=2,
        runtime="megatron-lm-2021",
    )
    graph = captured("gpt", 8, "export", **args)  # the microbatch
    megatron = plan_setup(theirs)
    ours = dataclasses.replace(megatron, runtime=AUTOPLAN)
    assert ours.loss_rows_batch_size == 16  # the plan's outputs are batch-major
    whole = dataclasses.replace(ours, runtime=dataclasses.replace(AUTOPLAN, name="whole"), loss_rows_batch_size=0)
    stock = dataclasses.replace(
        megatron, runtime=dataclasses.replace(AUTOPLAN, name="stock", kept_receive_buffers=True)
    )
    data = frozenset(value.name for value in graph.inputs)
    for index, stage in enumerate(theirs.stages):
        last = index == len(theirs.stages) - 1
        memory = {
            setup.runtime.name: sharded_stage_memory(
                stage,
                graph,
                setup,
                in_flight=1,
                num_microbatches=2,
                last=last,
                data_inputs=data,
                ddp=False,
                pipeline=True,
            )
            for setup in (megatron, ours, stock, whole)
        }
        assert memory["megatron-lm-2021"].held_bytes == memory["autoplan"].held_bytes == 0
        assert memory["stock"].held_bytes > 0
        if last:  # the whole logits gathered and the loss on them, against a quarter of both on each of 2 × 2 ranks
            assert memory["megatron-lm-2021"].peak_bytes <= memory["autoplan"].peak_bytes < memory["whole"].peak_bytes
    names = [node.name for node in graph.nodes]
    held = loss_and_output_bytes(graph, names, whole, num_devices=4)
    assert held > 0 and loss_and_output_bytes(graph, names, megatron, num_devices=4) == pytest.approx(held / 4)
    rows = loss_and_output_bytes(graph, names, ours, num_devices=4, mesh_shape=(2, 2), num_microbatches=2)
    assert rows == pytest.approx(held / 4)  # 8 rows over both axes
