"""Megatron sequence parallelism (planner.sharding.sequence_parallel): its strategies, their costs and memory,
the edges into gathered tensors, the Megatron incumbent that uses it, and the ILP choosing it on a GPT block.

Costs on the test cluster of tests/test_strategies.py (1 GB/s, 10 µs): on n = 2 devices an all-gather or a
reduce-scatter of a whole tensor of b bytes takes 1·10⁻⁵ s + b / 2 / 10⁹ s, an all-reduce twice that.
"""

from __future__ import annotations

import math

import pytest

from planner.costing.node_cost import node_cost
from planner.intra.incumbents import megatron_choice
from planner.intra.problem import evaluate
from planner.intra.solve import solve_intra_op
from planner.intra.stage_problem import StageProblem, build_stage_problem
from planner.intra.to_stage import stage_from_result
from planner.plan.report import _stage_line
from planner.sharding.sequence_parallel import computed_output
from planner.sharding.specs import GATHERED, REPLICATE, ShardingSpec, StageMesh, reshard_s, shard
from tests.conftest import by_name, captured, context, setup_for

R, G = REPLICATE, GATHERED
GPT_BLOCK = {"size": "tiny", "hidden": 1024, "heads": 16, "layers": 2, "seq": 256}


def gather_2(num_bytes: float) -> float:
    """All-gather (or reduce-scatter) of a whole tensor over 2 devices of the test link, written out."""
    return 1e-5 + num_bytes / 2 / 1e9


def spec(*placements: str) -> ShardingSpec:
    return ShardingSpec(tuple(placements))


def gpt():
    return captured("gpt", 8, "export")  # tiny: [8, 32, 64] activations, float32


def test_row_parallel_linear_reduce_scatters_its_partial_sum_along_the_sequence() -> None:
    proj = by_name(gpt(), "linear_3", (2,))  # blocks.0.attn.proj
    row, scattered = proj["k"], proj["k>1"]
    assert scattered.output == spec(shard(1)) and row.output == spec(R)
    assert scattered.inputs == row.inputs == (spec(shard(2)), None, None)
    assert scattered.collectives == (("reduce_scatter", 0, "forward", None), ("all_gather", 0, "backward", None))
    whole = 8 * 32 * 64 * 4
    assert scattered.comm_s == pytest.approx(2 * gather_2(whole), rel=1e-12)
    assert scattered.comm_s == pytest.approx(row.comm_s, rel=1e-12)  # on a ring, RS + AG move what AR moves
    assert computed_output(scattered, rank=3) == spec(R)  # the GEMM computes the whole (partial) output
    assert scattered.compute_shards == row.compute_shards == 2


def test_layer_norm_on_sequence_shards_gathers_its_output_for_the_column_parallel_linears() -> None:
    norms = by_name(gpt(), "layer_norm", (2,))
    gathered, sharded = norms["1*"], norms["1"]
    assert gathered.output == spec(G) and gathered.inputs == sharded.inputs == (spec(shard(1)), None, None)
    assert gathered.collectives == (("all_gather", 0, "forward", None), ("reduce_scatter", 0, "backward", None))
    assert gathered.comm_s == pytest.approx(2 * gather_2(8 * 32 * 64 * 4), rel=1e-12)
    assert gathered.compute_shards == 2 and gathered.grad_sync_axes == sharded.grad_sync_axes
    assert computed_output(gathered, rank=3) == spec(shard(1))
    assert "1*" not in by_name(gpt(), "add", (2,))  # the residual add feeds a norm, no linear: nothing to gather


def test_column_parallel_linear_reads_a_gathered_input_without_its_own_all_reduce() -> None:
    q = by_name(gpt(), "linear", (2,))  # blocks.0.attn.q, reading ln_1
    column, gathered = q["n"], q["n*"]
    assert column.collectives == (("all_reduce", 0, "backward", 0),)
    assert gathered.inputs[0] == spec(G) and gathered.collectives == () and gathered.comm_s == 0.0
    assert gathered.output == column.output == spec(shard(2))
    first = by_name(captured("mlp", 16, "export", hidden=64, layers=2), "linear", (2,))
    assert "n*" not in first  # its input is the model's input, not an operator that could gather it


def test_edges_into_a_gathered_tensor() -> None:
    mesh = context(gpt(), (2,)).mesh
    meta = gpt().node("layer_norm").output
    whole = meta.numel * 4
    all_reduce = 2 * gather_2(whole)
    assert reshard_s(spec(G), spec(G), meta, mesh) == 0.0  # the producer reduce-scatters the partial gradients
    assert reshard_s(spec(R), spec(G), meta, mesh) == pytest.approx(all_reduce, rel=1e-12)  # reduced on the edge
    assert reshard_s(spec(shard(1)), spec(G), meta, mesh) == pytest.approx(gather_2(whole) + all_reduce, rel=1e-12)
    assert reshard_s(spec(G), spec(R), meta, mesh) == 0.0
    # read as a shard: sliced locally, the gradient shard handed back as a partial sum (no all-gather backward)
    assert reshard_s(spec(R), spec(shard(1)), meta, mesh) == pytest.approx(gather_2(whole), rel=1e-12)
    assert reshard_s(spec(G), spec(shard(1)), meta, mesh) == 0.0
    two_d = context(gpt(), (2, 2)).mesh  # unless another axis splits the same dim: as from R
    both = spec(shard(1), shard(1))
    assert reshard_s(spec(R, G), both, meta, two_d) == reshard_s(spec(R, R), both, meta, two_d) > 0
    assert reshard_s(spec(R), spec(G), meta, mesh, requires_grad=False) == 0.0


def test_no_variant_on_a_one_device_axis() -> None:
    proj = by_name(gpt(), "linear_3", (1, 2))
    assert "- k>1" in proj and "k>1 -" not in proj
    assert "- 1*" in by_name(gpt(), "layer_norm", (1, 2)) and "1* -" not in by_name(gpt(), "layer_norm", (1, 2))


def test_a_gathered_dropouts_mask_is_charged_at_its_sequence_shard() -> None:
    graph = captured("gpt", 8, "export", attention="unfused", dropout=0.1)
    node = graph.node("dropout")  # attention probabilities [8, 4, 32, 32], read by probs @ v
    ctx = context(graph, (2,))
    strategies = by_name(graph, "dropout", (2,))
    setup = setup_for()
    mesh = StageMesh(cluster=setup.cluster, devices=(0, 1), mesh_shape=(2,))
    sharded, gathered = strategies["2"], strategies["2*"]
    mask = math.prod(node.output.shape)  # one byte an element
    for strategy in (sharded, gathered):
        cost = node_cost(node, strategy, setup, mesh, saved=False)
        assert cost.activation_bytes == mask / 2
    assert ctx.mesh.local_bytes(node.output, gathered.output) == node.output.numel * 4  # the output is whole


def gpt_block(shape: tuple[int, ...]) -> StageProblem:
    setup = setup_for()
    graph = captured("gpt", 8, "export", **GPT_BLOCK)
    mesh = StageMesh(
        cluster=setup.cluster,
        devices=tuple(range(math.prod(shape))),
        mesh_shape=shape,
        activation_itemsize=setup.activation_itemsize,
    )
    return build_stage_problem(graph, setup, mesh)


def activation_bytes(stage: StageProblem, choice: tuple[int, ...], name: str) -> float:
    variable = stage.variables.index(stage.representative[name])
    return stage.costs[variable][choice[variable]].activation_bytes


@pytest.mark.parametrize("shape", [(2,), (2, 4)])
def test_megatron_is_sequence_parallel_on_gpt_faster_and_smaller(shape: tuple[int, ...]) -> None:
    stage = gpt_block(shape)
    sequence, plain = megatron_choice(stage), megatron_choice(stage, sequence_parallel=False)
    assert megatron_choice(stage, sequence_parallel=True) == sequence
    (sequence_s, sequence_bytes), (plain_s, plain_bytes) = (
        evaluate(stage.problem, sequence),
        evaluate(stage.problem, plain),
    )
    assert sequence_s < plain_s and sequence_bytes < plain_bytes
    tensor = shape[-1]
    for name in ("add_1", "add_2"):  # the residual stream, what the layer norms keep: 1/t
        assert activation_bytes(stage, sequence, name) == activation_bytes(stage, plain, name) / tensor
    names = {n.module_path: n.name for n in stage.graph.nodes if n.op_name in ("linear", "layer_norm")}
    picked = {
        path: stage.strategies[v][sequence[v]].name.split(" ")[-1]
        for path, name in names.items()
        for v in [stage.variables.index(stage.representative[name])]
    }
    assert picked["blocks.0.attn.proj"] == picked["blocks.0.mlp.proj"] == "k>1"
    assert picked["blocks.0.ln_1"] == picked["blocks.0.ln_2"] == picked["ln_f"] == "1*"
    assert picked["blocks.0.attn.q"] == picked["blocks.0.mlp.fc"] == picked["lm_head"] == "n*"


def test_megatron_without_norms_between_its_linears_stays_plain() -> None:
    setup = setup_for()
    graph = captured("mlp", 64, "export", hidden=256, layers=3)
    mesh = StageMesh(cluster=setup.cluster, devices=(0, 1), mesh_shape=(2,), activation_itemsize=2)
    stage = build_stage_problem(graph, setup, mesh)
    assert megatron_choice(stage) == megatron_choice(stage, sequence_parallel=False)


def test_the_ilp_picks_sequence_parallelism_on_a_gpt_block_and_the_stage_says_so() -> None:
    setup = setup_for()
    graph = captured("gpt", 8, "export", **GPT_BLOCK)
    mesh = StageMesh(cluster=setup.cluster, devices=(0, 1), mesh_shape=(2,), activation_itemsize=2)
    result = solve_intra_op(graph, setup, mesh)
    stage = stage_from_result(result)
    assert stage.uses_sequence_parallelism and "sequence parallel" in _stage_line(stage)
    by_path = {node.module_path: stage.strategies[node.name] for node in graph.nodes if node.op_name == "layer_norm"}
    for path in ("blocks.0.ln_1", "blocks.1.ln_2"):  # golden: the norms gather for the column-parallel linears
        assert by_path[path].output_spec == (G,) and by_path[path].input_specs[0] == ("S(1)",)
    plain = evaluate(result.stage.problem, megatron_choice(result.stage, sequence_parallel=False))[0]
    assert result.objective_s < plain


def test_the_executor_pins_each_edge_as_the_cost_model_prices_it() -> None:
    """executors.parallel.dtensor_edges.node_edges on a sequence-parallel GPT record set: from a gathered norm, q
    reads R* (gradient kept partial), the residual add reads shards (sliced locally); from a sharded norm a reader of R*
    all-reduces the gradient on the edge (pinned replicated)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    from executors.parallel.dtensor_edges import node_edges
    from planner.plan import NodeSharding

    graph = gpt()
    q, add = graph.node("linear"), graph.node("add_1")  # add_1: the residual stream + attention's projection
    gathered = NodeSharding(split="1*", input_specs=(("S(1)",), None, None), output_spec=(G,))
    sharded = NodeSharding(split="1", input_specs=(("S(1)",), None, None), output_spec=("S(1)",))
    reader = NodeSharding(split="n*", input_specs=((G,), ("S(0)",), ("S(0)",)), output_spec=("S(2)",))
    residual = NodeSharding(split="1", input_specs=(("S(1)",), ("S(1)",)), output_spec=("S(1)",))
    edge = node_edges(q, reader, {"layer_norm": gathered})[0]
    assert (edge.source_pin, edge.sliced, edge.own_pin) == ((Partial(),), None, (Partial(),))
    assert node_edges(q, reader, {"layer_norm": sharded})[0].own_pin == (Replicate(),)
    assert node_edges(q, reader, {"layer_norm": sharded})[0].source_pin is None
    sliced = node_edges(add, residual, {add.inputs[0]: gathered, add.inputs[1]: sharded})  # as if post-LN
    assert (sliced[0].source_pin, sliced[0].sliced, sliced[0].own_pin) == ((Partial(),), (Shard(1),), None)
    assert sliced[1] == type(sliced[1])()  # shards from a sharded producer: the plain redistribution
