"""The cost model's price of the gathered gradient syncs (topk, onebit, threshold, terngrad, qsgd, signsgd):
the all-gather of the payloads' bytes, the encode and decode compute that grows with the group, the error-feedback
residuals' memory, and plans that carry a forced choice priced as the simulator runs it."""

from __future__ import annotations

import math

import pytest

from cost_models.cluster import Link, load_cluster
from cost_models.communication import all_gather_s, all_reduce_s
from cost_models.compute import RooflineCompute
from planner.api import plan_model_file
from planner.costing.compression import bucket_sync_s, sync_state_bytes
from planner.costing.lowering import lower_plan, simulate_lowered
from planner.costing.overlap import GradEntry, ReadyBucket, ddp_entries
from planner.costing.setup import CostSetup, plan_setup
from planner.costing.sync import gathered as gathered_sync
from planner.inter.grad_sync_choice import SyncChoice, offered
from planner.plan import GradSync
from tests.conftest import EXAMPLES, captured

ENTRIES = (GradEntry(name="w", shape=(1024, 1024), axes=(0,)), GradEntry(name="b", shape=(1024,), axes=(0,)))
# Σ payload bytes of ENTRIES per rank, by hand from planner/costing/sync/wire_bytes.py's formulas
HAND_PAYLOAD_BYTES = {
    "topk:0.01": 8 * (10486 + 11),  # k = ⌈0.01·N⌉ values and indices
    "onebit": (131072 + 8 * 1024) + (128 + 8),  # a bit an element, two values a column
    "threshold:0.001": (4 * 10486 + 1311) + (4 * 11 + 2),  # 1% of the elements: an index and a sign bit each
    "terngrad": (262144 + 4) + (256 + 4),  # 2 bits an element and a scale
    "qsgd:4": (524288 + 4) + (512 + 4),  # 9 signed levels in 4 bits and the norm
    "signsgd": (131072 + 4) + (128 + 4),  # a bit an element and the mean magnitude
}
SLOW = Link(bandwidth=125e6, latency_s=50e-6)  # 1 Gbit/s Ethernet-like
NVLINK = Link(bandwidth=300e9, latency_s=5e-6)  # NVLink-like


def _setup(optimizer: str = "adam-fp32") -> CostSetup:
    cluster = load_cluster("dgx-a100", num_nodes=1, devices_per_node=8)
    return CostSetup(cluster=cluster, compute=RooflineCompute(device=cluster.device), optimizer=optimizer)


@pytest.mark.parametrize("label", sorted(HAND_PAYLOAD_BYTES))
def test_a_bucket_all_gathers_its_payloads_bytes_from_every_rank(label: str) -> None:
    grad_sync, devices = GradSync.parse(label), 4
    comm, compress = bucket_sync_s(ENTRIES, [(devices, SLOW)], grad_sync, _setup())
    expected = all_gather_s(devices * HAND_PAYLOAD_BYTES[label], num_devices=devices, link=SLOW)
    if grad_sync.kind == "threshold":  # one int32 count per gradient all-gathered first
        expected += all_gather_s(devices * 4 * len(ENTRIES), num_devices=devices, link=SLOW)
    assert comm == pytest.approx(expected, rel=1e-12) and compress > 0
    exact, _ = bucket_sync_s(ENTRIES, [(devices, SLOW)], GradSync(), _setup())
    assert comm < exact  # every kind sends less than the fp32 all-reduce


def test_signsgd_compute_is_the_documented_bytes_and_kernels() -> None:
    setup, vector = _setup(), GradEntry(name="v", shape=(1 << 20,), axes=(0,))
    numel, payload = 1 << 20, (1 << 17) + 4
    moved = 24 * numel + 4 * payload  # encode, to_bytes and the bucket's concatenation
    moved += 2 * (24 * numel + payload + 12 * numel)  # two payloads: unpack and signs, stack and sum
    moved += (24 + 4) * numel  # sum's write, sign, scale, copy into the fp32 bucket
    kernels = (8 + 1) + 2 * (7 + 1) + 4
    device = setup.cluster.device
    expected = moved / (device.memory_bandwidth * device.memory_efficiency) + kernels * device.kernel_overhead_s
    _, compress = bucket_sync_s([vector], [(2, NVLINK)], GradSync.parse("signsgd"), setup)
    assert compress == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("label", sorted(HAND_PAYLOAD_BYTES))
def test_decoding_grows_with_the_group_one_payload_at_a_time(label: str) -> None:
    setup, grad_sync = _setup(), GradSync.parse(label)
    compute = [bucket_sync_s(ENTRIES, [(n, NVLINK)], grad_sync, setup)[1] for n in (2, 4, 8)]
    assert compute[0] < compute[1] < compute[2]
    assert compute[2] - compute[1] == pytest.approx(2 * (compute[1] - compute[0]), rel=1e-9)  # linear in n


def test_top_k_beats_exact_on_a_slow_link_and_loses_on_nvlink() -> None:
    setup, big = _setup(), [GradEntry(name="w", shape=(5000, 5000), axes=(0,))]
    topk = GradSync.parse("topk:0.01")
    for link, faster in ((SLOW, True), (NVLINK, False)):
        exact = sum(bucket_sync_s(big, [(8, link)], GradSync(), setup))
        compressed = sum(bucket_sync_s(big, [(8, link)], topk, setup))
        assert (compressed < exact) == faster, (link, compressed, exact)
    _, compute = bucket_sync_s(big, [(8, NVLINK)], topk, setup)
    assert compute > all_reduce_s(5000 * 5000 * 4, num_devices=8, link=NVLINK)  # the compute alone loses there


def test_threshold_is_priced_at_the_assumed_density(monkeypatch: pytest.MonkeyPatch) -> None:
    setup, grad_sync = _setup(), GradSync.parse("threshold:0.001")
    assert gathered_sync.sent_elements(grad_sync, 1000) == math.ceil(gathered_sync.THRESHOLD_DENSITY * 1000)
    comm, _ = bucket_sync_s(ENTRIES, [(4, SLOW)], grad_sync, setup)
    monkeypatch.setattr(gathered_sync, "THRESHOLD_DENSITY", 2 * gathered_sync.THRESHOLD_DENSITY)
    denser, _ = bucket_sync_s(ENTRIES, [(4, SLOW)], grad_sync, setup)
    counts = all_gather_s(4 * 4 * 2, num_devices=4, link=SLOW)
    assert comm == pytest.approx(
        all_gather_s(4 * HAND_PAYLOAD_BYTES["threshold:0.001"], num_devices=4, link=SLOW) + counts
    )
    at_two_percent = (4 * 20972 + 2622) + (4 * 21 + 3)  # s = ⌈0.02·N⌉: 20972 and 21
    assert denser == pytest.approx(all_gather_s(4 * at_two_percent, num_devices=4, link=SLOW) + counts)
    choice = SyncChoice(grad_sync=grad_sync, step_s=1.0, state_bytes=0.0, exact_step_s=2.0)
    assert "reach the threshold" in choice.note()  # the plan's note says what the price assumes
    assert (
        "reach" not in SyncChoice(grad_sync=GradSync.parse("topk:0.01"), step_s=1, state_bytes=0, exact_step_s=2).note()
    )


@pytest.mark.parametrize("optimizer", ["adam-fp32", "adam-mixed"])
def test_error_feedback_kinds_keep_an_fp32_residual_per_gradient(optimizer: str) -> None:
    buckets = [ReadyBucket(entries=ENTRIES, ready_s=0.0), ReadyBucket(entries=ENTRIES[:1], ready_s=1.0)]
    numel = 2 * (1 << 20) + 1024
    itemsize = 4 if optimizer == "adam-fp32" else 2
    for label in HAND_PAYLOAD_BYTES:
        grad_sync = GradSync.parse(label)
        expected = 4 * numel if grad_sync.error_feedback else 0
        assert sync_state_bytes(buckets, grad_sync, itemsize=itemsize) == expected, label
    assert offered(allow_lossy=False, forced=GradSync.parse("onebit")) == (GradSync.parse("onebit"),)


def _mlp_plan(grad_sync: str | None, *, slow: bool = False, optimizer: str | None = None):
    """A data-parallel MLP plan on 2 local-cpu nodes, or (``slow``) a wider one on 2 nodes of 1 Gbit/s Ethernet."""
    if slow:
        cluster = load_cluster(str(EXAMPLES / "clusters" / "ethernet-1g.toml"), num_nodes=2)
    else:
        cluster = load_cluster("local-cpu", num_nodes=2, devices_per_node=1)
    return plan_model_file(
        EXAMPLES / "mlp.py",
        cluster,
        batch_size=64 if slow else 8,
        model_args={"hidden": 1024 if slow else 256, "layers": 2},
        method="data-parallel",
        optimizer=optimizer,
        allow_lossy=grad_sync is not None,
        grad_sync=grad_sync,
    )


def test_a_forced_top_k_plan_carries_its_choice_estimate_and_residual() -> None:
    exact, topk, qsgd = _mlp_plan(None), _mlp_plan("topk:0.01"), _mlp_plan("qsgd:4")
    assert topk.grad_sync == GradSync.parse("topk:0.01") and exact.grad_sync == GradSync()
    assert topk.estimate.step_time_s != pytest.approx(exact.estimate.step_time_s, rel=1e-6)
    assert any("topk:0.01" in note and "exact sync" in note for note in topk.notes)
    graph = captured("mlp", 8 // topk.num_microbatches, "export", hidden=256, layers=2)
    num_params = sum(math.prod(entry.shape) for entry in ddp_entries(graph))
    assert topk.zero == qsgd.zero == 0  # the same layout (exact sync may pick ZeRO, which refuses lossy syncs)
    added = topk.estimate.memory_per_device_bytes - qsgd.estimate.memory_per_device_bytes
    assert added == pytest.approx(4 * num_params, abs=2)  # top-k's fp32 residual of every gradient, QSGD keeps none
    lowered = lower_plan(topk, graph, plan_setup(topk))
    assert any(segment.compress_s > 0 for segment in lowered.sync_segments[0])
    assert simulate_lowered(lowered).step_time_s == pytest.approx(topk.estimate.step_time_s, rel=1e-6)


@pytest.mark.parametrize("choice", ["topk:0.01", "qsgd:4"])
def test_a_gathered_sharded_plan_is_priced_as_the_simulator_runs_it(choice: str) -> None:
    cluster = load_cluster("p3.16xlarge", num_nodes=2)
    plan = plan_model_file(
        EXAMPLES / "gpt.py",
        cluster,
        batch_size=16,
        model_args={"size": "tiny"},
        method="megatron",
        degrees=(8, 1, 2),
        optimizer="adam-fp32",
        allow_lossy=True,
        grad_sync=choice,
    )
    assert plan.grad_sync == GradSync.parse(choice)
    graph = captured("gpt", 16 // plan.num_microbatches, "export", size="tiny")
    lowered = lower_plan(plan, graph, plan_setup(plan))
    assert any(segment.compress_s > 0 for segment in lowered.sync_segments[0])
    assert simulate_lowered(lowered).step_time_s == pytest.approx(plan.estimate.step_time_s, rel=1e-9)
    assert plan.estimate.savings.grad_sync_saved_s is not None


def test_delayed_averaging_leaves_exposed_what_d_backwards_do_not_hide() -> None:
    from planner.costing.overlap import SyncSegment
    from planner.costing.sync.delayed import delayed_segments

    segments = [SyncSegment(backward_s=0.1, all_reduce_s=0.6), SyncSegment(backward_s=0.2, all_reduce_s=0.4)]
    cut = delayed_segments(segments, backward_s=0.3, delay=2)  # C = 1.0, hidden 0.6: 0.4 left, in proportion
    assert [s.all_reduce_s for s in cut] == pytest.approx([0.24, 0.16])
    assert [s.backward_s for s in cut] == [0.1, 0.2]
    assert all(s.all_reduce_s == 0 for s in delayed_segments(segments, backward_s=0.3, delay=4))


@pytest.mark.parametrize(("choice", "optimizer"), [("dga:4", "adam-fp32"), ("dgc:0.001", "sgd-momentum")])
def test_dga_and_dgc_plans_are_priced_as_the_simulator_runs_them(choice: str, optimizer: str) -> None:
    plan, bf16 = _mlp_plan(choice, slow=True, optimizer=optimizer), _mlp_plan("bf16", slow=True, optimizer=optimizer)
    assert plan.grad_sync == GradSync.parse(choice)
    assert plan.estimate.savings.grad_sync_saved_s > 0  # on 1 Gbit/s either saves time over the same DDP plan
    graph = captured("mlp", 64 // plan.num_microbatches, "export", hidden=1024, layers=2)
    num_params = sum(math.prod(entry.shape) for entry in ddp_entries(graph))
    state = {"dga:4": 2 * 5 * 4 * num_params, "dgc:0.001": 8 * num_params}[choice]  # the queue; u and v
    assert bf16.zero == plan.zero == 0  # the same DDP layout; bf16 keeps no state
    assert plan.estimate.memory_per_device_bytes - bf16.estimate.memory_per_device_bytes == pytest.approx(state, abs=2)
    lowered = lower_plan(plan, graph, plan_setup(plan))
    assert simulate_lowered(lowered).step_time_s == pytest.approx(plan.estimate.step_time_s, rel=1e-6)


def test_dgc_is_refused_without_sgd_momentum_and_dga_outside_ddp() -> None:
    from planner.errors import AutoplanError

    with pytest.raises(AutoplanError, match="sgd-momentum"):
        _mlp_plan("dgc:0.001", slow=True, optimizer="adam-fp32")
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    with pytest.raises(AutoplanError, match=r"needs a one-stage data-parallel plan \(DDP\)"):
        plan_model_file(
            EXAMPLES / "mlp.py",
            cluster,
            batch_size=8,
            model_args={"hidden": 32, "layers": 1},
            method="megatron",
            degrees=(2, 1, 1),
            allow_lossy=True,
            grad_sync="dga:2",
        )


def test_a_forced_sync_slower_than_exact_says_more_not_a_negative_less() -> None:
    slower = SyncChoice(grad_sync=GradSync.parse("topk:0.01"), step_s=2.5, state_bytes=0, exact_step_s=2.0)
    assert "0.5 s more than exact sync (2 s)" in slower.note() and "-" not in slower.note().split("step")[-1]


def _auto_on_one_slow_node(*, hidden: int, bandwidth: float, latency_s: float):
    import dataclasses

    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=8)
    cluster = dataclasses.replace(cluster, intra_node=Link(bandwidth=bandwidth, latency_s=latency_s))
    return plan_model_file(
        EXAMPLES / "mlp.py",
        cluster,
        batch_size=64,
        model_args={"hidden": hidden, "layers": 1},
        method="data-parallel",
        allow_lossy=True,
    )


def test_auto_picks_a_parameter_server_where_latency_alone_is_the_cost() -> None:
    """Tiny gradients on a 1 ms link inside one node: an all-reduce pays 2(n − 1) latencies a bucket, an all-gather
    n − 1, a parameter server's push and pull one each for the whole gradient; local SGD needs several nodes."""
    plan = _auto_on_one_slow_node(hidden=8, bandwidth=10e9, latency_s=1e-3)
    assert plan.grad_sync.kind == "ps" and plan.grad_sync.same_update, plan.grad_sync
    assert plan.estimate.savings.grad_sync_saved_s > 0


def test_auto_picks_a_gathered_sync_where_bandwidth_and_latency_both_cost() -> None:
    """On 100 Mbit/s with 1 ms latency a parameter server still sends every fp32 gradient element: one of the
    gathered choices auto may pick (TernGrad, QSGD 16, signSGD), 2 bits an element or less, is the fastest."""
    plan = _auto_on_one_slow_node(hidden=64, bandwidth=12.5e6, latency_s=1e-3)
    assert plan.grad_sync.gathered, plan.grad_sync
    assert plan.estimate.savings.grad_sync_saved_s > 0


def test_the_simulated_dga_step_shows_its_whole_communication_hidden_and_exposed() -> None:
    """DGA's timeline: the bucket all-reduces the step waits for plus the background ones behind the next ``D`` steps
    add up to exact sync's communication; the step time is still the estimate; exact sync hides nothing."""
    from dataclasses import replace

    from planner.cli.show import simulated_line
    from planner.costing.sync.delayed import sync_timeline

    plan = _mlp_plan("dga:1", slow=True)
    graph = captured("mlp", 64 // plan.num_microbatches, "export", hidden=1024, layers=2)
    result = simulate_lowered(lower_plan(plan, graph, plan_setup(plan)), record=True)
    exact_plan = replace(plan, grad_sync=GradSync())
    exact_lowered = lower_plan(exact_plan, graph, plan_setup(exact_plan))
    full_s = math.fsum(segment.all_reduce_s for segment in exact_lowered.sync_segments[0])
    split = sync_timeline(result)
    assert split.hidden_s > 0 and split.exposed_s > 0  # on 1 Gbit/s one backward hides part of it
    assert split.hidden_s + split.exposed_s == pytest.approx(full_s, rel=1e-9)
    assert result.background_s == pytest.approx(split.hidden_s, rel=1e-12)
    assert result.step_time_s == pytest.approx(plan.estimate.step_time_s, rel=1e-6)
    assert "hidden" in simulated_line(plan, result) and "behind 1 steps" in simulated_line(plan, result)
    exact = simulate_lowered(exact_lowered, record=True)
    assert sync_timeline(exact).hidden_s == 0 == exact.background_s
    assert sync_timeline(exact).exposed_s == pytest.approx(full_s, rel=1e-9)
