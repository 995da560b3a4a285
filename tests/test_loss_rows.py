"""The rows a sharded last stage runs the loss on (planner.plan.stage.loss_row_axes): which mesh axes, when the outputs
are batch-major (two captures), and what the memory model charges for them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from cost_models.cluster import load_cluster
from planner.api import plan_prepared, prepare_model_file
from planner.costing.plan_memory import sharded_stage_memory
from planner.costing.setup import plan_setup
from planner.ir.capture import capture
from planner.ir.rebatch import outputs_scale_with_batch
from planner.plan.stage import loss_row_axes, loss_row_split
from tests.conftest import EXAMPLES, captured


@pytest.mark.parametrize(
    ("mesh_shape", "rows", "axes"),
    [
        ((2,), 4, (0,)),
        ((2, 2), 4, (0, 1)),
        ((2, 4), 4, (1,)),  # the largest split that divides the rows
        ((2, 2), 2, (0,)),  # a tie: the earlier axis
        ((4, 2), 6, (1,)),
        ((1, 4), 6, ()),  # nothing divides: whole on every rank
        ((8,), 1, ()),
        ((2, 1, 2), 8, (0, 2)),
    ],
)
def test_row_axes_take_the_largest_split_that_divides_the_rows(
    mesh_shape: tuple[int, ...], rows: int, axes: tuple[int, ...]
) -> None:
    assert loss_row_axes(mesh_shape, rows=rows) == axes
    for axis in axes:
        assert mesh_shape[axis] > 1
    assert rows % loss_row_split(mesh_shape, rows=rows) == 0


class _Summed(nn.Module):
    """Outputs whose dim 0 is not the batch: a sum over the rows (dim 0 is the features)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).sum(0)


class _SequenceFirst(nn.Module):
    """Outputs laid out sequence first ([S, B, H]) from batch-first inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).transpose(0, 1).contiguous()


class _Flattened(nn.Module):
    """Outputs flattened to [B·S, H]: still batch-major (S entries per row)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).reshape(-1, 4)


@pytest.mark.parametrize(("module", "batch_major"), [(_Summed, False), (_SequenceFirst, False), (_Flattened, True)])
def test_batch_major_outputs_are_proved_by_two_captures(module: type[nn.Module], batch_major: bool) -> None:
    model = module()
    low = capture(model, (torch.randn(2, 3, 4),))
    high = capture(model, (torch.randn(6, 3, 4),))
    assert outputs_scale_with_batch(low, high, sizes=(2, 6)) is batch_major
    assert not outputs_scale_with_batch(high, high, sizes=(6, 6))  # one capture proves nothing


def test_gpt_logits_are_batch_major() -> None:
    low, high = captured("gpt", 2), captured("gpt", 8)
    assert outputs_scale_with_batch(low, high, sizes=(2, 8))


def test_memory_charges_each_rank_its_rows_of_the_outputs() -> None:
    """A (2,1,2) GPT plan's one stage keeps 1/4 of the logits and the loss on them (4 rows over both axes), the
    same plan read as whole outputs (an old plan) holds all of them: the difference is 3/4 of the outputs and
    the loss's tensors."""
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=4)
    prepared = prepare_model_file(
        EXAMPLES / "gpt.py", cluster, batch_size=8, model_args={}, degrees=(2, 1, 2), microbatches=2
    )
    plan = plan_prepared(prepared, "megatron")
    assert plan.outputs_batch_major
    assert loss_row_axes(plan.stages[0].mesh_shape, rows=4) == (0, 1)
    graph = prepared.graphs.at(4)
    memories = {}
    for batch_major in (True, False):
        setup = plan_setup(replace(plan, outputs_batch_major=batch_major))
        memories[batch_major] = sharded_stage_memory(
            plan.stages[0],
            graph,
            setup,
            in_flight=1,
            num_microbatches=2,
            last=True,
            data_inputs=frozenset(v.name for v in graph.inputs),
            ddp=False,
        )
    (logits,) = (graph.node(name).output for name in graph.outputs)
    loss = setup.loss_bytes_per_output_element * logits.numel
    saved = memories[False].peak_bytes - memories[True].peak_bytes
    assert saved > 0
    assert saved <= 0.75 * (logits.nbytes + loss) + 1
