"""Headroom: a plan's memory budget is the device's capacity less a reserve, times --memory-fraction."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cost_models.cluster import (
    CPU_RESERVE_BYTES,
    GPU_FIXED_RESERVE_BYTES,
    GPU_FRAGMENTATION_SHARE,
    Cluster,
    describe_memory_budget,
    load_cluster,
    memory_budget_bytes,
    reserved_bytes,
    usable_memory_bytes,
)
from cost_models.units import GIB
from planner.api import plan_model_file
from planner.baselines.method_options import gib_text
from planner.costing.setup import plan_setup
from planner.errors import AutoplanError
from planner.plan import Plan, load_plan, save_plan
from tests.conftest import EXAMPLES
from tests.conftest import LAB_CLUSTER_TOML as TOML

# 9 blocks of 16896 x 16896 (5.1e9 parameters, 16 B each with mixed-precision Adam): 76.6 GiB per device
# under data parallelism, inside an A100's 80 GiB but over its 72.6 GiB budget.
BIG_MLP = {"hidden": 16896, "layers": 9}


def test_gpu_preset_reserves_context_nccl_and_fragmentation() -> None:
    a100 = load_cluster("dgx-a100")
    expected = GPU_FIXED_RESERVE_BYTES + int(GPU_FRAGMENTATION_SHARE * 80 * GIB)
    assert a100.device.memory_reserve_bytes is None  # the default for the kind
    assert reserved_bytes(a100.device) == expected
    assert memory_budget_bytes(a100) == 80 * GIB - expected
    assert memory_budget_bytes(a100, memory_fraction=0.5) == (80 * GIB - expected) / 2
    assert describe_memory_budget(a100) == (
        "72.6 GiB (80.0 GiB less 7.4 GiB reserved for CUDA context, NCCL buffers and allocator fragmentation)"
    )
    assert describe_memory_budget(a100, memory_fraction=0.5).startswith("36.3 GiB (memory fraction 0.5 of 72.6 GiB: ")
    v100 = load_cluster("p3.16xlarge").device
    assert reserved_bytes(v100) == GPU_FIXED_RESERVE_BYTES + int(GPU_FRAGMENTATION_SHARE * 16 * GIB)


def test_cpu_keeps_a_small_reserve() -> None:
    local = load_cluster("local-cpu")
    assert reserved_bytes(local.device) == CPU_RESERVE_BYTES
    assert usable_memory_bytes(local.device) == local.device.memory_bytes - CPU_RESERVE_BYTES
    assert "Python interpreter" in describe_memory_budget(local)
    tiny = dataclasses.replace(local.device, memory_bytes=CPU_RESERVE_BYTES // 2)
    assert usable_memory_bytes(tiny) == 0  # never negative


def test_cluster_file_sets_the_reserve_and_it_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "lab.toml"
    path.write_text(TOML.replace("memory_bandwidth = 300e9", "memory_bandwidth = 300e9\nmemory_reserve_bytes = 2e9"))
    cluster = load_cluster(str(path))
    assert cluster.device.memory_reserve_bytes == 2_000_000_000
    assert memory_budget_bytes(cluster) == 22_000_000_000
    assert "by the cluster's memory_reserve_bytes" in describe_memory_budget(cluster)
    data = json.loads(json.dumps(cluster.to_json()))
    assert data["device"]["memory_reserve_bytes"] == 2_000_000_000
    assert Cluster.from_json(data) == cluster
    default = load_cluster("dgx-a100")
    data = json.loads(json.dumps(default.to_json()))
    assert "memory_reserve_bytes" not in data["device"] and Cluster.from_json(data) == default  # the default
    data["device"]["memory_reserve_bytes"] = None  # a JSON null is the default too
    assert Cluster.from_json(data) == default


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("-1", "field memory_reserve_bytes must be a positive integer"),
        ("24e9", r"memory_reserve_bytes \(24000000000\) must be less than memory_bytes"),
    ],
)
def test_bad_reserve_in_a_cluster_file(tmp_path: Path, value: str, message: str) -> None:
    path = tmp_path / "lab.toml"
    path.write_text(
        TOML.replace("memory_bandwidth = 300e9", f"memory_bandwidth = 300e9\nmemory_reserve_bytes = {value}")
    )
    with pytest.raises(AutoplanError, match=message):
        load_cluster(str(path))


def test_zero_reserve_is_allowed(tmp_path: Path) -> None:
    path = tmp_path / "lab.toml"
    path.write_text(TOML.replace("memory_bandwidth = 300e9", "memory_bandwidth = 300e9\nmemory_reserve_bytes = 0"))
    assert memory_budget_bytes(load_cluster(str(path))) == 24_000_000_000


def _one_a100(reserve: int | None) -> Cluster:
    cluster = load_cluster("dgx-a100", devices_per_node=1)
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_reserve_bytes=reserve))


def test_a_plan_that_filled_the_whole_device_is_refused() -> None:
    whole = plan_model_file(EXAMPLES / "mlp.py", _one_a100(0), batch_size=8, method="data-parallel", model_args=BIG_MLP)
    need = whole.estimate.memory_per_device_bytes
    assert memory_budget_bytes(load_cluster("dgx-a100")) < need <= 80 * GIB  # fit under the old rule
    with pytest.raises(AutoplanError) as error:
        plan_model_file(EXAMPLES / "mlp.py", _one_a100(None), batch_size=8, method="data-parallel", model_args=BIG_MLP)
    assert str(error.value) == (  # the state alone is over the budget of the one device: only devices help
        f"does not fit: the weights, gradients and optimizer state (adam-mixed) alone need {gib_text(need)} GiB on the "
        "one device, the budget is 72.6 GiB (80.0 GiB less 7.4 GiB reserved for CUDA context, NCCL "
        "buffers and allocator fragmentation): no batch, recomputation or ZeRO level changes that; use at least 2 "
        "devices at this budget"
    )


def test_plan_records_its_memory_fraction(tmp_path: Path) -> None:
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    made = plan_model_file(
        EXAMPLES / "mlp.py",
        cluster,
        batch_size=8,
        method="data-parallel",
        memory_fraction=0.5,
        model_args={"hidden": 64, "layers": 2},
    )
    assert made.memory_fraction == 0.5
    assert made.memory_budget_bytes == memory_budget_bytes(cluster, memory_fraction=0.5)
    assert plan_setup(made).memory_budget_bytes == made.memory_budget_bytes
    save_plan(made, tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json") == made
    data = made.to_json()
    del data["memory_fraction"]  # plans written before the field: the whole usable memory
    assert Plan.from_json(data).memory_fraction == 1.0


def test_the_summary_states_the_headroom_left_on_the_fullest_device() -> None:
    from planner.plan.report import headroom_bytes, plan_summary

    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    args = {"hidden": 64, "layers": 2}
    made = plan_model_file(EXAMPLES / "mlp.py", cluster, batch_size=8, method="data-parallel", model_args=args)
    left = made.memory_budget_bytes - made.estimate.memory_per_device_bytes
    assert headroom_bytes(made) == left > 0
    share = left / made.memory_budget_bytes
    assert f"GiB budget ({left / GIB:.2f} GiB ({share:.0%}) left on the fullest device)" in plan_summary(made)
    estimate = dataclasses.replace(made.estimate, memory_per_device_bytes=int(made.memory_budget_bytes + GIB))
    over = dataclasses.replace(made, estimate=estimate)
    assert headroom_bytes(over) == -GIB and "1.00 GiB (" in plan_summary(over) and " over)" in plan_summary(over)
