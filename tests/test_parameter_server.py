"""The parameter server (``--grad-sync ps:S[:K]``): where it runs, what it costs, and that it trains as defined (and
that the program's clipping threshold reaches DGC's local clipping, in the same torchrun job).

The multi-process cases (``tests/parameter_server_worker.py``, gloo, world 2 and 4) train the MLP for six AdamW steps
with clipping: a synchronous server must match one process step by step (loss, norm, every gradient by relative
norm: ``--check-parity``); a stale one (staleness ``K``) must match a single-process run in which each step's
gradient is applied ``K`` steps late — its loss at every step and every parameter at the end.
"""

from __future__ import annotations

import json

import pytest

from cost_models.cluster import Link, load_cluster
from cost_models.compute import RooflineCompute
from planner.api import plan_model_file
from planner.costing.lowering import lower_plan, simulate_lowered
from planner.costing.setup import CostSetup, plan_setup
from planner.costing.sync.parameter_server import exchange_s, ps_sync, server_ranks, server_shards
from planner.errors import AutoplanError
from planner.plan import GradSync, save_plan
from tests.conftest import EXAMPLES, captured, torchrun

MAX_GRAD_NORM = 0.05  # tests/parameter_server_worker.py's
RELATIVE = 1e-4  # float32 on both sides, summed in another order, over six AdamW steps


def test_the_command_line_form_takes_servers_and_an_optional_staleness() -> None:
    sync, stale = GradSync.parse("ps:4"), GradSync.parse("ps:4:2")
    assert (sync.servers, sync.staleness, sync.warmup_steps, sync.label) == (4, 0, 0, "ps:4")
    assert (stale.servers, stale.staleness, stale.label) == (4, 2, "ps:4:2")
    assert sync.same_update and not stale.same_update and sync.lossy
    assert GradSync.from_json(stale.to_json()) == stale
    for bad in ("ps", "ps:0", "ps:2:x", "ps:1.5", "dga:4:2"):
        with pytest.raises(AutoplanError):
            GradSync.parse(bad)
    with pytest.raises(AutoplanError, match="takes no staleness"):
        GradSync(kind="dga", delay=2, warmup_steps=3, staleness=1)


def test_servers_spread_over_the_replicas_and_shards_balance_by_size() -> None:
    assert server_ranks(range(8), 2) == (0, 4) and server_ranks(range(4), 4) == (0, 1, 2, 3)
    sizes = [10, 70, 30, 30, 5]
    shards = server_shards(sizes, 2)
    loads = [sum(size for size, shard in zip(sizes, shards, strict=True) if shard == k) for k in range(2)]
    assert shards[1] == 0 and sorted(loads) == [70, 75]  # the largest first, then the least-loaded shard


def _two_by_two(inter: Link, intra: Link):
    import dataclasses

    cluster = load_cluster("local-cpu", num_nodes=2, devices_per_node=2)
    return dataclasses.replace(cluster, inter_node=inter, intra_node=intra, nics_per_node=1)


def test_a_push_lasts_as_long_as_its_busiest_endpoint() -> None:
    """Two nodes of two devices, one NIC a node; servers on ranks 0 and 2 (one a node), shards of 100 bytes.
    Inter-node: each node sends 2 × 100 out (its replicas to the other node's server) and receives 2 × 100, one NIC:
    α + 200/β. Intra-node: each server receives 100 from its neighbour: α' + 100/β'."""
    inter, intra = Link(bandwidth=100.0, latency_s=0.5), Link(bandwidth=1000.0, latency_s=0.01)
    cluster = _two_by_two(inter, intra)
    time = exchange_s([100.0, 100.0], servers=(0, 2), devices=(0, 1, 2, 3), cluster=cluster)
    assert time == pytest.approx(max(0.5 + 200 / 100, 0.01 + 100 / 1000))
    one = exchange_s([200.0], servers=(0,), devices=(0, 1, 2, 3), cluster=cluster)  # one server: node 0 receives 400
    assert one == pytest.approx(0.5 + 400 / 100)


def _setup() -> CostSetup:
    cluster = _two_by_two(Link(bandwidth=1e9, latency_s=1e-3), Link(bandwidth=1e11, latency_s=1e-5))
    return CostSetup(cluster=cluster, compute=RooflineCompute(device=cluster.device), optimizer="adam-fp32")


def test_staleness_hides_the_push_and_servers_hold_their_shards_optimizer_state() -> None:
    sizes, devices = [1 << 20] * 4, (0, 1, 2, 3)
    sync = ps_sync(sizes, devices=devices, servers=4, staleness=0, backward_s=0.001, setup=_setup())
    stale = ps_sync(sizes, devices=devices, servers=4, staleness=2, backward_s=0.001, setup=_setup())
    assert sync.hidden_s == 0 and stale.hidden_s == pytest.approx(0.002)
    assert stale.exposed_s == pytest.approx(sync.exposed_s - 0.002)
    assert sync.optimizer_share == 0.25
    numel, grad = 4 << 20, 4
    buffers = (numel + 3 * (1 << 20)) * grad + 4 * numel  # send all, receive 3 shards, the pulled parameters
    assert sync.state_bytes == pytest.approx(buffers - 0.75 * 8 * numel)  # Adam's state of the shards served elsewhere


def _mlp_plan(grad_sync: str, *, nodes: int, per_node: int, optimizer: str = "adam-fp32", **keywords):
    return plan_model_file(
        EXAMPLES / "mlp.py",
        load_cluster("local-cpu", num_nodes=nodes, devices_per_node=per_node),
        batch_size=8,
        model_args={"hidden": 32, "layers": 2},
        method="data-parallel",
        optimizer=optimizer,
        grad_sync=grad_sync,
        **keywords,
    )


@pytest.mark.parametrize("choice", ["ps:2", "ps:4:2"])
def test_a_parameter_server_plan_is_priced_as_the_simulator_runs_it(choice: str) -> None:
    plan = _mlp_plan(choice, nodes=2, per_node=2, allow_lossy=True)
    assert plan.grad_sync == GradSync.parse(choice)
    assert any(choice in note for note in plan.notes)
    graph = captured("mlp", 8 // plan.num_microbatches, "export", hidden=32, layers=2)
    lowered = lower_plan(plan, graph, plan_setup(plan))
    assert simulate_lowered(lowered).step_time_s == pytest.approx(plan.estimate.step_time_s, rel=1e-9)
    assert plan.estimate.breakdown_error() is None


def test_a_synchronous_server_needs_no_allow_lossy_but_is_refused_outside_ddp() -> None:
    assert _mlp_plan("ps:2", nodes=1, per_node=2).grad_sync == GradSync.parse("ps:2")
    with pytest.raises(AutoplanError, match="add --allow-lossy"):
        _mlp_plan("ps:2:1", nodes=1, per_node=2)
    with pytest.raises(AutoplanError, match="at least 4 replicas"):
        _mlp_plan("ps:4", nodes=1, per_node=2)
    with pytest.raises(AutoplanError, match=r"one-stage data-parallel plan \(DDP\)"):
        plan_model_file(
            EXAMPLES / "mlp.py",
            load_cluster("local-cpu", num_nodes=1, devices_per_node=2),
            batch_size=8,
            model_args={"hidden": 32, "layers": 1},
            method="megatron",
            degrees=(2, 1, 1),
            grad_sync="ps:2",
        )


CASES = {2: ((1, 2), ("ps:1", "ps:2", "ps:2:2", "dgc:0.1")), 4: ((2, 2), ("ps:2", "ps:4:1"))}


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(CASES))
def test_parameter_servers_train_as_defined(world: int, tmp_path) -> None:
    (nodes, per_node), choices = CASES[world]
    paths = []
    for choice in choices:
        path = tmp_path / f"{choice.replace(':', '_')}.json"
        optimizer = "sgd-momentum" if choice.startswith("dgc") else "adam-fp32"  # DGC keeps SGD's momentum
        save_plan(_mlp_plan(choice, nodes=nodes, per_node=per_node, optimizer=optimizer, allow_lossy=True), path)
        paths.append(path)
    out = tmp_path / "report.json"
    done = torchrun(world, "parameter_server_worker.py", out, paths)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    for choice, path in zip(choices, paths, strict=True):
        result = report[str(path)]
        if "dgc_local_clip" in result:  # the program's threshold reached DGC's hook at the first clip
            assert result["dgc_local_clip"] == [None, MAX_GRAD_NORM], result
            continue
        if "parity" in result:
            assert len(result["parity"]) == 6, choice
            assert all(step["ok"] for step in result["parity"]), (choice, result["parity"])
            continue
        losses, reference = result["losses"], result["reference_losses"]
        assert len(losses) == len(reference) == 6
        assert losses == pytest.approx(reference, rel=RELATIVE), choice
        assert max(result["param_errors"].values()) <= RELATIVE, (choice, result["param_errors"])
