"""Executor host overheads: the cost model charges them, and the probe fit recovers them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from calibration.probes import (
    COMPUTE_PROBE_FILE,
    COMPUTE_PROBES,
    PROBES,
    _probe_configs,
    probe_degrees,
)
from calibration.runtime_fit import COMPUTE, CONSTANTS, ProbeRow, apply_runtime, fit_runtime, probe_features
from cost_models.cluster import Cluster, load_cluster
from planner.api import plan_prepared, prepare_model_file
from planner.costing.lowering import simulate_plan
from planner.errors import AutoplanError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MLP_ARGS = {"hidden": 32, "layers": 4}


def _cluster(world: int = 2) -> Cluster:
    return apply_runtime(load_cluster("local-cpu", num_nodes=1, devices_per_node=world), dict.fromkeys(CONSTANTS, 0.0))


def _estimate(cluster: Cluster, method: str, **options) -> float:
    prepared = prepare_model_file(EXAMPLES / "mlp.py", cluster, batch_size=8, model_args=MLP_ARGS, **options)
    return plan_prepared(prepared, method).estimate.step_time_s


def test_cluster_file_round_trips_runtime_constants() -> None:
    values = {
        "kernel_overhead_s": 3e-5,
        "sharded_op_overhead_s": 4e-4,
        "microbatch_overhead_s": 1e-3,
        "step_overhead_s": 5e-3,
        "latency_s": 2e-4,
    }
    cluster = apply_runtime(_cluster(), values)
    back = Cluster.from_json(cluster.to_json())
    assert back.device == cluster.device
    assert (back.intra_node, back.inter_node) == (cluster.intra_node, cluster.inter_node)
    assert back.inter_node.latency_s == 2e-4
    assert back.device.sharded_op_overhead_s == 4e-4 and back.intra_node.latency_s == 2e-4
    assert back.device.compute_efficiency == back.device.memory_efficiency == 0.5


def test_older_cluster_files_load_with_no_runtime_overheads() -> None:
    data = _cluster().to_json()
    for key in ("sharded_op_overhead_s", "microbatch_overhead_s", "step_overhead_s"):
        del data["device"][key]
    device = Cluster.from_json(data).device
    assert device.sharded_op_overhead_s == device.microbatch_overhead_s == device.step_overhead_s == 0.0


def test_step_overhead_is_paid_once_by_every_method() -> None:
    base = _cluster()
    more = apply_runtime(base, {"step_overhead_s": 0.01})
    for method, options in (("data-parallel", {}), ("megatron", {"degrees": (2, 1, 1)}), ("hash", {})):
        assert _estimate(more, method, **options) - _estimate(base, method, **options) == pytest.approx(0.01)


def test_sharded_dispatch_is_charged_on_multi_device_stages_only() -> None:
    base = _cluster()
    more = apply_runtime(base, {"sharded_op_overhead_s": 1e-3})
    tensor = {"degrees": (2, 1, 1)}
    assert _estimate(more, "megatron", **tensor) > _estimate(base, "megatron", **tensor) + 10e-3
    pipeline = {"degrees": (1, 2, 1), "schedule": "gpipe", "microbatches": 2}  # one device per stage
    assert _estimate(more, "megatron", **pipeline) == pytest.approx(_estimate(base, "megatron", **pipeline))
    assert _estimate(more, "data-parallel") == pytest.approx(_estimate(base, "data-parallel"))  # runs as DDP


def test_microbatch_overhead_is_charged_per_stage_and_microbatch_of_pipelines() -> None:
    base, more = _cluster(), apply_runtime(_cluster(), {"microbatch_overhead_s": 1e-3})
    for m in (2, 4):
        pipeline = {"degrees": (1, 2, 1), "schedule": "gpipe", "microbatches": m}
        added = _estimate(more, "megatron", **pipeline) - _estimate(base, "megatron", **pipeline)
        assert added == pytest.approx((m + 1) * 1e-3)  # Σ over 2 stages + (m − 1) × the longest
    tensor = {"degrees": (2, 1, 1)}
    assert _estimate(more, "megatron", **tensor) == pytest.approx(_estimate(base, "megatron", **tensor))


def test_simulator_charges_the_same_overheads() -> None:
    base = _cluster()
    more = apply_runtime(base, {"microbatch_overhead_s": 1e-3, "step_overhead_s": 5e-3})
    pipeline = {"degrees": (1, 2, 1), "schedule": "gpipe", "microbatches": 2}
    simulated = []
    for cluster in (base, more):
        prepared = prepare_model_file(EXAMPLES / "mlp.py", cluster, batch_size=8, model_args=MLP_ARGS, **pipeline)
        plan = plan_prepared(prepared, "megatron")
        simulated.append(simulate_plan(plan, prepared.graphs.at(4), prepared.setup).step_time_s)
    assert simulated[1] - simulated[0] == pytest.approx(3e-3 + 5e-3)


def test_probe_features_are_the_slopes_of_a_linear_estimate() -> None:
    weights = {
        "kernel_overhead_s": 40,
        "sharded_op_overhead_s": 7,
        "microbatch_overhead_s": 3,
        "step_overhead_s": 1,
        "latency_s": 12,
    }

    def estimate(cluster: Cluster) -> float:
        device = cluster.device
        return 0.002 + sum(
            w * (cluster.intra_node.latency_s if k == "latency_s" else getattr(device, k)) for k, w in weights.items()
        )

    base, features = probe_features(estimate, _cluster())
    assert base == pytest.approx(0.002)
    assert features == pytest.approx(weights)


def test_fit_recovers_known_constants_and_keeps_them_non_negative() -> None:
    truth = {
        "kernel_overhead_s": 5e-5,
        "sharded_op_overhead_s": 3e-4,
        "microbatch_overhead_s": 0.0,
        "step_overhead_s": 4e-3,
        "latency_s": 7e-4,
    }
    rows = []
    for i in range(10):
        features = {k: float((i * 7 + j * 3) % 11 + (i == j) * 5) for j, k in enumerate(CONSTANTS)}
        measured = 0.001 + sum(features[k] * truth[k] for k in CONSTANTS)
        rows.append(ProbeRow(name=f"p{i}", measured_s=measured, base_s=0.001, features=features))
    fit = fit_runtime(rows)
    assert fit.values == pytest.approx(truth, abs=1e-9)
    assert all(fit.predicted_s(row) == pytest.approx(row.measured_s) for row in rows)
    # a probe that ran faster than its base estimate cannot drive a constant below zero
    fast = [replace(row, measured_s=row.base_s * 0.5) for row in rows]
    assert all(value >= 0 for value in fit_runtime(fast).values.values())


def test_fit_recovers_a_signed_compute_share_and_applies_it() -> None:
    truth = {
        "sharded_op_overhead_s": 3e-4,
        "microbatch_overhead_s": 1e-3,
        "step_overhead_s": 4e-3,
        "latency_s": 7e-4,
        COMPUTE: -0.2,
    }
    rows = []
    for i in range(10):
        features = {k: float((i * 7 + j * 3) % 11 + (i == j) * 5) for j, k in enumerate(truth)}
        features[COMPUTE] = 0.01 * (1 + i % 4)  # seconds of compute in the probe
        measured = 0.05 + sum(features[k] * truth[k] for k in truth)
        rows.append(ProbeRow(name=f"p{i}", measured_s=measured, base_s=0.05, features=features))
    fit = fit_runtime(rows)
    assert set(fit.values) == set(truth)  # no kernel overhead feature: it is not fitted
    assert fit.values == pytest.approx(truth, abs=1e-9)
    cluster = _cluster()
    scaled = apply_runtime(cluster, {COMPUTE: -0.2})
    assert scaled.device.shared_slowdown == pytest.approx(0.8 * cluster.device.shared_slowdown)
    assert scaled.device.peak("float32") == pytest.approx(cluster.device.peak("float32") / 0.8)
    assert apply_runtime(cluster, {COMPUTE: 0.0}).device == cluster.device


def test_profiled_probe_configs_add_the_compute_probes() -> None:
    assert set(_probe_configs(profiled=False)) == set(PROBES)
    profiled = _probe_configs(profiled=True)
    assert set(profiled) == set(PROBES) | set(COMPUTE_PROBES)
    assert {profiled[name][0] for name in COMPUTE_PROBES} == {COMPUTE_PROBE_FILE}


def test_fit_needs_enough_probes() -> None:
    row = ProbeRow(name="p", measured_s=1.0, base_s=0.5, features=dict.fromkeys(CONSTANTS, 1.0))
    with pytest.raises(AutoplanError, match="at least as many probes"):
        fit_runtime([row])


def test_every_probe_plans_on_two_and_four_devices() -> None:
    for world in (2, 4):
        cluster = _cluster(world)
        for path, args, batch, method, options in _probe_configs(profiled=True).values():
            options = dict(options)
            if "degrees" in options:
                options["degrees"] = probe_degrees(options["degrees"], world)
            prepared = prepare_model_file(path, cluster, batch_size=batch, optimizer="sgd", model_args=args, **options)
            plan = plan_prepared(prepared, method)
            assert plan.estimate.step_time_s > 0 and plan.cluster.num_devices == world


def test_simulator_prices_pure_data_parallel_as_ddp() -> None:
    """DDP runs on plain tensors (no sharded dispatch) and copies every gradient into its bucket and back."""
    from planner.costing.estimate import DDP_BUCKET_COPIES

    base = _cluster()
    more = apply_runtime(base, {"sharded_op_overhead_s": 1e-3})
    simulated, steps = [], []
    for cluster in (base, more):
        prepared = prepare_model_file(EXAMPLES / "mlp.py", cluster, batch_size=8, model_args=MLP_ARGS)
        plan = plan_prepared(replace(prepared, options=replace(prepared.options, zero="0")), "data-parallel")
        steps.append(plan.estimate)
        simulated.append(simulate_plan(plan, prepared.graphs.at(8), prepared.setup).step_time_s)
    assert simulated[1] == pytest.approx(simulated[0])
    device = base.device
    grad_bytes = 4 * prepared.graph.num_params  # fp32 gradients on local-cpu
    copies = DDP_BUCKET_COPIES * grad_bytes / (device.memory_bandwidth * device.memory_efficiency)
    assert steps[0].breakdown_s["optimizer_and_bucket_copies_s"] >= copies
    assert simulated[0] >= copies
