"""A plan whose ranks would capture the model at rows where its graph has other operators is refused at planning
time (planner.inter.runnable_rows): the forced method says what to change, auto leaves that candidate out, a
placement takes fewer microbatches. The model branches on its batch size, as Hugging Face models' exports do in
effect at one row (torch.export specialises a dimension of size 1)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cost_models.cluster import load_cluster
from planner.api import plan_prepared, prepare
from planner.errors import AutoplanError
from planner.inter.runnable_rows import rows_refusal, runtime_rows
from planner.ir.graph import node_difference

HIDDEN = 16


class BatchDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if x.shape[0] > 1:  # a branch on the batch: one operator fewer at one row
            h = torch.relu(h)
        return self.fc2(h)


def prepared(batch_size: int, **options: object):
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=4)
    return prepare(BatchDependent(), (torch.randn(batch_size, HIDDEN),), cluster, batch_size=batch_size, **options)


def test_the_graph_at_one_row_differs_and_says_how() -> None:
    graphs = prepared(4).graphs
    assert node_difference(graphs.full, graphs.full) is None
    difference = node_difference(graphs.full, graphs.at(1))
    assert difference is not None and difference.startswith("2 against 3 operators")
    assert node_difference(graphs.full, graphs.at(2)) is None


def test_data_parallel_at_one_row_per_replica_is_refused_with_what_to_change() -> None:
    with pytest.raises(AutoplanError) as refused:
        plan_prepared(prepared(4), "data-parallel")
    message = str(refused.value)
    assert "runs 1 row(s) of the batch per replica and microbatch" in message
    assert "2 against 3 operators" in message and "at least 2 rows" in message
    plan = plan_prepared(prepared(8), "data-parallel")  # two rows per replica: the same graph
    assert runtime_rows(stages=plan.stages, num_microbatches=plan.num_microbatches, batch_size=8) == (
        2,
        "replica and microbatch",
    )


def test_auto_leaves_out_the_candidates_its_ranks_could_not_run() -> None:
    setup = prepared(4)
    plan = plan_prepared(setup, "auto")
    assert (
        rows_refusal(stages=plan.stages, num_microbatches=plan.num_microbatches, graphs=setup.graphs, what="") is None
    )
    assert any(note.startswith("left out: auto's data-parallel candidate runs 1 row(s)") for note in plan.notes)


def test_a_placement_takes_fewer_microbatches_where_one_row_has_another_graph() -> None:
    setup = prepared(4)
    plan = plan_prepared(setup, "hash")
    assert plan.num_microbatches == 2
    assert any(note.startswith("not 4 microbatches") for note in plan.notes)
    with pytest.raises(AutoplanError, match="per microbatch"):  # asked for: refused, not changed
        plan_prepared(prepared(4, microbatches=4), "hash")
