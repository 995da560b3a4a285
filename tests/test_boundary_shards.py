"""Values crossing a pipeline boundary as shards (planner.plan.stage.boundary_spec, sends_shards): which boundaries
and specs, the runner's record of them, and what the memory model stops charging."""

from __future__ import annotations

import pytest

from cost_models.cluster import load_cluster
from executors.parallel.pipeline import boundary_shards, stage_segments
from planner.api import plan_prepared, prepare_model_file
from planner.costing.plan_memory import sharded_stage_memory
from planner.costing.setup import plan_setup
from planner.plan.stage import boundary_spec, sends_shards
from tests.conftest import EXAMPLES


@pytest.mark.parametrize(
    ("output_spec", "mesh_shape", "shape", "spec"),
    [
        (("S(0)",), (2,), (4, 3), ("S(0)",)),
        (("S(0)", "R"), (2, 2), (4, 3), ("S(0)", "R")),
        (("S(0)", "S(0)"), (2, 2), (4, 3), ("S(0)", "S(0)")),  # dim 0 split over both axes
        (("S(0)", "S(2)"), (2, 2), (4, 3, 8), ("S(0)", "S(2)")),
        (("S(1)",), (2,), (3, 4), ("S(1)",)),  # a sequence split crosses as it is
        (("R*",), (2,), (4, 3), ("R",)),  # gathered: whole
        (("S(0)", "S(1)"), (4, 2), (6, 4), ("R", "S(1)")),  # 4 does not divide 6 rows: that split is gathered
        (("S(0)", "S(0)"), (1, 2), (4, 3), ("R", "S(0)")),  # an axis of one device splits nothing
    ],
)
def test_a_value_crosses_in_the_splits_of_its_output_spec_that_divide_evenly(
    output_spec: tuple[str, ...], mesh_shape: tuple[int, ...], shape: tuple[int, ...], spec: tuple[str, ...]
) -> None:
    assert boundary_spec(output_spec, mesh_shape=mesh_shape, shape=shape) == spec


def test_shards_cross_only_between_meshes_of_one_shape_in_an_even_pipeline() -> None:
    assert sends_shards([(2,), (2,)], 0)
    assert not sends_shards([(2,), (2,)], 1)  # the last stage sends nothing
    assert not sends_shards([(1,), (1,)], 0)  # one device: nothing to split
    assert not sends_shards([(2, 2), (4,)], 0)  # rank i holds another shard in the other shape
    assert not sends_shards([(2,), (2,), (1,)], 0)  # stages of different sizes: another runner, whole values
    assert sends_shards([(2, 2), (2, 2), (2, 2)], 1)


@pytest.fixture(scope="module")
def pipeline():
    """GPT over (tensor 1, pipeline 2, data 2) on four devices: two stages of two replicas each."""
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=4)
    prepared = prepare_model_file(
        EXAMPLES / "gpt.py", cluster, batch_size=8, model_args={}, degrees=(1, 2, 2), schedule="gpipe", microbatches=2
    )
    plan = plan_prepared(prepared, "megatron")
    return plan, prepared.graphs.at(plan.batch_size // plan.num_microbatches)


def test_the_runner_sends_the_first_stages_computed_values_as_their_shards(pipeline) -> None:
    plan, graph = pipeline
    segments = stage_segments(graph, plan, loss_inputs=())
    rows = boundary_shards(graph, plan, segments)
    sent = {segments[0].outputs[p]: axes for p, axes in rows[0].outputs.items()}
    received = {segments[1].inputs[p]: axes for p, axes in rows[1].inputs.items()}
    assert sent and sent == received
    assert set(sent.values()) == {("S(0)",)}
    for name in sent:
        assert plan.stages[0].strategies[name].output_spec == ("S(0)",)
    assert not rows[1].outputs and not rows[0].inputs  # the last stage sends nothing; the first reads the data


def test_sending_shards_drops_the_gathered_copy_of_the_sent_values(pipeline) -> None:
    """Stage 0 keeps its sent values as its shards (half) instead of gathering them whole: the copy it stops making is
    half of each, held until the microbatch's backward."""
    plan, graph = pipeline
    stage = plan.stages[0]
    setup = plan_setup(plan)
    data = frozenset(v.name for v in graph.inputs)
    memory = {
        sending: sharded_stage_memory(
            stage,
            graph,
            setup,
            in_flight=2,
            num_microbatches=2,
            last=False,
            data_inputs=data,
            ddp=False,
            pipeline=True,
            sends_shards=sending,
        )
        for sending in (True, False)
    }
    segments = stage_segments(graph, plan, loss_inputs=())
    sent = boundary_shards(graph, plan, segments)[0].outputs
    assert setup.activation_itemsize is None  # fp32 on the CPU cluster: each value at its own dtype
    half = sum(graph.node(segments[0].outputs[p]).output.nbytes / 2 for p in sent)
    saved = memory[False].kept_bytes - memory[True].kept_bytes
    assert saved == pytest.approx(half)
    # the microbatch in flight besides the one at its peak keeps the copy
    assert memory[False].total_bytes - memory[True].total_bytes == pytest.approx(half)
