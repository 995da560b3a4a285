"""The activations' timeline and the terms it charges (cost_models.memory_timeline, planner.costing.stage_memory):
each figure computed by hand from the tensors' sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cost_models.cluster import preset
from cost_models.compute import RooflineCompute
from cost_models.loss_memory import DEFAULT_BYTES_PER_OUTPUT_ELEMENT, loss_bytes_per_output_element
from cost_models.memory import aliases_input, attention_dropout_bytes, index_bytes, rnn_kept_bytes
from cost_models.memory_timeline import Tape, TapeOp, activation_peak
from planner.costing.estimate import ddp_bucket_bytes, replica_memory
from planner.costing.setup import CostSetup
from planner.ir.capture import capture
from planner.ir.graph import OpGraph


def _graph(module: nn.Module, *inputs: torch.Tensor) -> OpGraph:
    with torch.device("meta"):
        return capture(module.to("meta"), tuple(x.to("meta") for x in inputs))


def _cpu_setup() -> CostSetup:
    cluster = preset("local-cpu")
    return CostSetup(cluster=cluster, compute=RooflineCompute(device=cluster.device), optimizer="sgd")


def test_timeline_frees_saved_tensors_after_their_first_saver_and_gradients_after_their_producer() -> None:
    # x -> a (keeps x) -> b (keeps a) -> c (keeps nothing), c the output; n = 3, t = 0..6 (backward of k at 6 − k)
    ops = (
        TapeOp(name="a", output_bytes=100, grad_bytes=100, reads=("x",), saves=("x",)),
        TapeOp(name="b", output_bytes=200, grad_bytes=200, reads=("a",), saves=("a",)),
        TapeOp(name="c", output_bytes=50, grad_bytes=50, reads=("b",)),
    )
    tape = Tape(ops=ops, inputs={"x": 10}, outputs=("c",), loss_bytes=30)
    peak = activation_peak(tape)
    # t=5 (b's backward): x 10 + a 100 (kept until b's backward ends) + c 50 (held output)
    #                     + grad b 200 (made at t=4 by c's backward) + grad a 100 (made by b's backward)
    assert peak.peak_bytes == 460 and peak.at == 5 and peak.phase(3) == "backward"
    assert peak.kept_bytes == 10 + 100 + 50  # alive at the loss: x, a (kept for b), c (the output); b was freed
    assert peak.end_bytes == 10 + 50 + 100  # x, c and a's gradient (x needs none) when the backward ends
    forward_and_loss = activation_peak(Tape(ops=ops[:2], inputs={"x": 10}, outputs=("b",), loss_bytes=1000))
    assert forward_and_loss.peak_bytes == 10 + 100 + 200 + 1000 and forward_and_loss.phase(2) == "loss"


def test_parameter_gradients_accumulate_from_their_backward_to_the_end() -> None:
    ops = (
        TapeOp(name="a", output_bytes=100, grad_bytes=100, reads=("x",), saves=("x",), param_grad_bytes=1000),
        TapeOp(name="b", output_bytes=200, grad_bytes=200, reads=("a",), saves=("a",)),
        TapeOp(name="c", output_bytes=50, grad_bytes=50, reads=("b",), transient_bytes=7, backward_bytes=3),
    )
    peak = activation_peak(Tape(ops=ops, inputs={"x": 10}, outputs=("c",), loss_bytes=30))
    assert peak.peak_bytes == 160 + 1000 and peak.at == 6  # the end: x, c, grad a and a's parameters' gradient
    # c's transient at its forward (t=2: x 10 + a 100 + b 200 + c 50 + 7) and backward (t=4: + 3 more)
    assert activation_peak(Tape(ops=ops[2:], inputs={"b": 0}, outputs=("c",))).peak_bytes == 50 + 7 + 3 + 50


def test_replica_memory_of_a_small_mlp_by_hand() -> None:
    """Linear(16, 32) → ReLU → Linear(32, 8) at batch 4, float32, SGD, the default loss (the output's gradient):
    x 256 B; linear 512 B kept by relu; relu 512 B kept by linear_1; the output 128 B held; activation gradients
    as large; parameter gradients 2176 B (544 parameters) and 1056 B (264). The peak is the backward's end:
    x 256 + output 128 + grad of the first linear's output 512 + parameter gradients 3232."""
    graph = _graph(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)), torch.randn(4, 16))
    assert [node.op_name for node in graph.nodes] == ["linear", "relu", "linear"]
    memory = replica_memory(graph, _cpu_setup(), num_devices=1)
    assert memory.state_bytes == (544 + 264) * 4  # SGD: the weights only (their gradients are the timeline's)
    assert memory.peak_bytes == 256 + 128 + 512 + 2176 + 1056
    assert memory.kept_bytes == 256 + 512 + 512 + 128
    assert memory.total_bytes == memory.state_bytes + memory.peak_bytes
    assert ddp_bucket_bytes(graph, _cpu_setup(), num_devices=1) == 0  # no DDP on one device
    assert ddp_bucket_bytes(graph, _cpu_setup(), num_devices=2) == (544 + 264) * 4  # one more gradient


def test_a_dropout_keeps_its_noise_on_a_cpu_and_a_byte_mask_on_a_gpu() -> None:
    graph = _graph(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)), torch.randn(4, 8))
    from cost_models.memory import dropout_mask

    dropout = next(node for node in graph.nodes if "dropout" in node.op_name)
    assert dropout_mask(dropout, fused=True).nbytes == 32 and dropout_mask(dropout, fused=False).nbytes == 128
    identity = _graph(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.0)), torch.randn(4, 8))
    assert all(aliases_input(node) for node in identity.nodes if "dropout" in node.op_name)


def test_in_place_operators_and_views_allocate_nothing() -> None:
    graph = _graph(nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Flatten(0)), torch.randn(4, 8))
    kinds = {node.op_name: aliases_input(node) for node in graph.nodes}
    assert kinds["linear"] is False and kinds["relu_"] is True and any(kinds[k] for k in kinds if k != "linear")


def test_max_pooling_keeps_int64_indices_one_per_output_element() -> None:
    graph = _graph(nn.MaxPool2d(2), torch.randn(2, 3, 8, 8))
    (pool,) = graph.nodes
    assert index_bytes(pool) == 2 * 3 * 4 * 4 * 8


@pytest.mark.parametrize(("rnn", "name", "units"), [(nn.GRU, "gru", 7), (nn.LSTM, "lstm", 7), (nn.RNN, "rnn_tanh", 1)])
def test_an_rnn_keeps_its_per_step_tensors_and_its_inner_layer_outputs(rnn: type, name: str, units: int) -> None:
    batch, seq, hidden, layers = 2, 3, 4, 2
    graph = _graph(rnn(5, hidden, num_layers=layers, batch_first=True, bidirectional=True), torch.randn(2, 3, 5))
    node = next(node for node in graph.nodes if node.op_name == name)
    per_step = layers * 2 * seq * batch * units * hidden * 4  # layers · directions · T · B · units · H, float32
    inner = (layers - 1) * seq * batch * 2 * hidden * 4  # the first layer's output, the second's input
    assert rnn_kept_bytes(node) == per_step + inner
    dropped = _graph(rnn(5, hidden, num_layers=layers, dropout=0.5), torch.randn(3, 2, 5))
    node = next(node for node in dropped.nodes if node.op_name == name)
    masks = (layers - 1) * seq * batch * hidden  # one byte per inner-layer output element
    assert rnn_kept_bytes(node) == layers * seq * batch * units * hidden * 4 + masks * 4 + masks


def test_attention_dropout_keeps_three_score_matrices_without_a_fused_kernel() -> None:
    class Attention(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)

    q = torch.randn(2, 4, 8, 16)
    (node,) = [n for n in _graph(Attention(), q, q, q).nodes if n.kind == "attention"]
    assert attention_dropout_bytes(node, fused=False) == 3 * 2 * 4 * 8 * 8 * 4
    assert attention_dropout_bytes(node, fused=True) == 0


def test_cross_entropy_holds_its_log_softmax_and_two_gradients() -> None:
    """F.cross_entropy on [B, V] logits: the log-softmax output (kept), its gradient and the logits' gradient,
    float32 each: 12 bytes per logit at the peak; the mean (no loss_fn) holds the output's gradient: 4."""
    logits = torch.empty(64, 1000, device="meta")
    targets = torch.zeros(64, dtype=torch.long, device="meta")
    per_element = loss_bytes_per_output_element(lambda out, data: F.cross_entropy(out, data[0]), [logits], (targets,))
    assert per_element == pytest.approx(12.0, rel=0.01)
    assert loss_bytes_per_output_element(None, [logits], ()) == DEFAULT_BYTES_PER_OUTPUT_ELEMENT == 4.0


@pytest.mark.slow
def test_the_estimate_of_a_data_parallel_mlp_is_within_bounds_of_its_measured_peak(tmp_path: Path) -> None:
    """Two gloo ranks train examples/mlp.py (hidden 256, 4 blocks, batch 64) with DDP: each rank's peak, the CPU
    allocator's count over one profiled step (executors.measure.memory_peak: deterministic for a fixed program),
    against the plan's estimate: within 15%, never more than 10% under. Parts by hand: 2.01 MiB of weights held,
    as much in DDP's buckets, and the step's gradients (2.01 MiB) with the largest activation gradients."""
    from executors.measure.step_timing import run_timing
    from planner.api import plan_model_file
    from planner.plan import save_plan
    from tests.conftest import EXAMPLES

    cluster = preset("local-cpu").with_shape(num_nodes=1, devices_per_node=2)
    args = {"hidden": 256, "layers": 4}
    plan = plan_model_file(
        EXAMPLES / "mlp.py", cluster, batch_size=64, model_args=args, method="data-parallel", optimizer="sgd", zero="0"
    )
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    out = tmp_path / "peaks.json"
    peaks = run_timing([str(path)], world=2, steps=2, out=out, module="executors.measure.memory_peak")[str(path)]
    weights = (256 * 256 + 256) * 2 * 4 * 4  # 4 blocks of two 256x256 linears with biases, float32
    assert all(peak > 3 * weights for peak in peaks), (peaks, weights)  # weights, buckets, gradients at least
    error = plan.estimate.memory_per_device_bytes / max(peaks) - 1
    assert -0.10 <= error <= 0.15, (plan.estimate.memory_per_device_bytes, peaks)
