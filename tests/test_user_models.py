"""Models as users write them, in one process: a forward that makes a constant tensor (which ``torch.export``
lifts out of the module, as in Falcon's attention), a forward that returns a dict (as Hugging Face
``ModelOutput``s do), and a DTensor gradient whose local shard is laid out otherwise than it claims (the
shared cause of "view size is not compatible" in a tied GPT-2's and an LSTM LM's backward).

The runs on ranks are the compatibility sweep's (``tests/test_compat.py``, ``benchmarks/compat.py``).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from executors.graph_module import GraphModule, make_segment, model_output, model_tensors, output_names
from executors.parallel.dtensor_edges import contiguous_local_grad
from executors.session import attach_constants, default_loss
from planner.ir.capture import capture
from planner.ir.graph import OpGraph


class ShiftByConstant(nn.Module):
    """Falcon-like: the forward builds ``torch.tensor([-2, 1])`` and uses it."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * torch.tensor([-2.0, 1.0])


class DictOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        hidden = self.proj(x)
        return {"logits": hidden.relu(), "features": hidden, "extra": None}


def _run_graph(graph: OpGraph, model: nn.Module, x: torch.Tensor) -> tuple[Any, ...]:
    """The whole graph as one GraphModule on ``model``'s tensors, as a one-device runner runs it."""
    params, buffers = model_tensors(model)
    segment = make_segment(graph, [node.name for node in graph.nodes], needed_after=graph.outputs)
    return GraphModule(graph, segment, params=params, buffers=buffers)(x)


def test_a_lifted_constant_travels_with_the_graph_to_the_model_of_each_rank() -> None:
    torch.manual_seed(0)
    model, x = ShiftByConstant(), torch.randn(3, 4)
    graph = capture(model, (x,))
    (constant,) = graph.constants
    assert constant.name == "lifted_tensor_0"  # made in the root module's forward
    assert constant.values == (-2.0, 1.0) and constant.meta.shape == (2,)
    assert constant.name in {buffer.name for buffer in graph.buffers}
    shipped = pickle.loads(pickle.dumps(graph))  # as a planning worker receives it
    assert shipped.constants == graph.constants and shipped.fingerprint() == graph.fingerprint()
    attach_constants(model, shipped)  # what each rank's Workload.build does
    assert constant.name in dict(model.named_buffers()) and constant.name not in model.state_dict()
    (got,) = _run_graph(shipped, model, x)
    torch.testing.assert_close(got, model(x))


def test_a_dict_output_reaches_the_loss_as_the_model_returns_it() -> None:
    torch.manual_seed(0)
    model, x = DictOutput(), torch.randn(3, 4)
    graph = capture(model, (x,))
    values = _run_graph(graph, model, x)
    assert len(values) == len(output_names(graph)) == 2
    output = model_output(graph, values)
    expected = model(x)
    assert set(output) == {"logits", "features", "extra"} and output["extra"] is None
    torch.testing.assert_close(output["logits"], expected["logits"])
    torch.testing.assert_close(output["features"], expected["features"])
    torch.testing.assert_close(default_loss(output, (x,)), expected["logits"].mean())


def test_an_fx_capture_keeps_the_output_structure_too() -> None:
    model, x = DictOutput(), torch.randn(3, 4)
    graph = capture(model, (x,), tracer="fx")
    output = model_output(graph, _run_graph(graph, model, x))
    assert output["extra"] is None and output["logits"].shape == (3, 3)


def test_a_single_tensor_or_a_tuple_output_is_what_the_model_returns() -> None:
    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x.sin(), x.cos()

    x = torch.randn(2, 2)
    pair = model_output(capture(Pair(), (x,)), (x.sin(), x.cos()))
    assert isinstance(pair, tuple) and len(pair) == 2
    single = capture(nn.Linear(2, 2), (x,))
    assert isinstance(model_output(single, (x,)), torch.Tensor)
    unpickled = pickle.loads(pickle.dumps(capture(Pair(), (x,))))  # a graph that crossed processes: no structure
    assert unpickled.output_tree is None and model_output(unpickled, (x,)) is x


@pytest.fixture
def one_rank_mesh() -> Iterator[DeviceMesh]:
    """A gloo group of this process alone, and its mesh (destroyed after the test)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", [0])
    finally:
        dist.destroy_process_group()


def test_a_gradient_laid_out_otherwise_than_it_claims_is_made_contiguous_before_a_view_backward(
    one_rank_mesh: DeviceMesh,
) -> None:
    """A redistribution's backward may hand back a DTensor whose strides say contiguous while its local shard is
    transposed; a view's backward then views the local shard and fails. The hook every tensor-parallel node output
    gets (:func:`executors.parallel.dtensor_edges.contiguous_local_grad`) copies it first."""

    def viewed() -> tuple[DTensor, DTensor]:
        x = DTensor.from_local(torch.randn(6, 4), one_rank_mesh, [Replicate()], run_check=False).requires_grad_()
        return x, x.view(2, 3, 4)

    local = torch.randn(3, 2, 4).transpose(0, 1)
    claimed = (12, 4, 1)  # contiguous strides for [2, 3, 4]; the local shard's are (4, 8, 1)
    grad = DTensor.from_local(local, one_rank_mesh, [Replicate()], run_check=False, shape=(2, 3, 4), stride=claimed)
    _, bare = viewed()
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        bare.backward(grad)
    x, hooked = viewed()
    hooked.register_hook(contiguous_local_grad)
    hooked.backward(grad)
    assert torch.equal(x.grad.to_local(), local.reshape(6, 4))


def test_a_number_computed_in_the_forward_and_returned_is_no_graph_value() -> None:
    class WithCount(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, Any]:
            return {"out": x.relu(), "rows": x.shape[0] * 2}

    x = torch.randn(3, 2)
    graph = capture(WithCount(), (x,))
    assert output_names(graph) == ("relu",)
    output = model_output(graph, (x.relu(),))
    assert output["rows"] == 6 and torch.equal(output["out"], x.relu())
