"""Per-operator sharding rules (planner.sharding.strategies, planner.sharding.op_rules): linear, attention, embedding,
convolution, norms, softmax, broadcasts and MoE einsums. How strategies follow views and shapes, and the sweep
over every example's strategies, are ``tests/test_strategy_shapes.py``.

Costs are hand-worked with the ring formulas of cost_models.communication on one node of 8
devices linked at 1 GB/s, 10 µs: on n = 4 devices an all-reduce of b bytes is
6·10⁻⁵ s + 1.5·b / 10⁹ s, so 2,048 bytes (an 8×64 float32 activation) take 6.3072·10⁻⁵ s.
"""

from __future__ import annotations

import pytest

from planner.costing.node_cost import grad_values
from planner.ir.graph import GraphValue, NodeKind, OpGraph, OpNode, TensorArg, TensorMeta, ValueKind
from planner.sharding.op_rules import enumerate_strategies
from planner.sharding.specs import REPLICATE, ShardingSpec, shard
from tests.conftest import by_name, captured, context

R = REPLICATE

MLP = {"hidden": 64, "layers": 2}
RESNET = {"width": 8}
MOE = {"hidden": 32, "tokens": 8, "ffn": 64}


def all_reduce_4(num_bytes: float) -> float:
    """Ring all-reduce over 4 devices of TOY_LINK (tests/conftest.py), written out."""
    return 6 * 1e-5 + 1.5 * num_bytes / 1e9


def grad_sync_4(num_bytes: float) -> float:
    """A gradient's additive share of a bucketed all-reduce over 4 devices: its share of a 25 MiB bucket's
    latency (a sharded stage's executor reduces gradients in buckets, executors.parallel.grad_sync), written out."""
    return min(1.0, num_bytes / (25 * 1024**2)) * 6 * 1e-5 + 1.5 * num_bytes / 1e9


def spec(*placements: str) -> ShardingSpec:
    return ShardingSpec(tuple(placements))


# --- linear ---------------------------------------------------------------------------------


def mlp() -> OpGraph:
    return captured("mlp", 8, "export", **MLP)


def test_linear_on_four_devices_has_batch_column_and_row_splits():
    graph = mlp()
    node = graph.node("linear")
    assert node.inputs == ("x", "blocks.0.fc1.weight", "blocks.0.fc1.bias")
    strategies = by_name(graph, "linear", (4,))
    # none, batch, column (out features), row (in features), row reduce-scattered along the tokens (sequence parallel)
    assert set(strategies) == {"-", "a", "n", "k", "k>0"}
    assert strategies["-"].compute_shards == 1
    assert all(strategies[name].compute_shards == 4 for name in ("a", "n", "k"))
    none = strategies["-"]
    assert none.output == spec(R) and none.inputs == (spec(R), None, None)
    assert none.comm_s == 0.0 and none.grad_sync_s == 0.0


def test_linear_column_split():
    graph = mlp()
    assert "x" not in grad_values(graph)  # a graph input: no gradient
    column = by_name(graph, "linear", (4,))["n"]
    assert column.output == spec(shard(1))
    assert column.inputs == (spec(R), None, None)
    assert dict(column.params) == {"blocks.0.fc1.weight": spec(shard(0)), "blocks.0.fc1.bias": spec(shard(0))}
    assert column.comm_s == 0.0  # the input needs no gradient, so nothing to all-reduce backward
    assert column.grad_sync_s == 0.0  # every weight and bias element lives on one device
    assert dict(column.grad_sync_axes) == {"blocks.0.fc1.weight": (), "blocks.0.fc1.bias": ()}
    # with the input needing its gradient: Megatron's f, an all-reduce of the whole input grad
    needs_x = grad_values(graph) | {"x"}
    column = by_name(graph, "linear", (4,), grad=needs_x)["n"]
    assert column.comm_s == pytest.approx(all_reduce_4(8 * 64 * 4), rel=1e-12)
    assert column.comm_s == pytest.approx(6.3072e-5, rel=1e-12)
    # the second block's fc1 reads an activation, which needs its gradient
    assert "add" in grad_values(graph)
    assert by_name(graph, "linear_2", (4,))["n"].comm_s == pytest.approx(6.3072e-5, rel=1e-12)


def test_linear_row_split():
    row = by_name(mlp(), "linear", (4,))["k"]
    assert row.output == spec(R)
    assert row.inputs == (spec(shard(1)), None, None)
    assert dict(row.params) == {"blocks.0.fc1.weight": spec(shard(1)), "blocks.0.fc1.bias": spec(R)}
    # forward all-reduce of the partial sums: the whole (8, 64) float32 output
    assert row.comm_s == pytest.approx(all_reduce_4(8 * 64 * 4), rel=1e-12)
    # the bias gradient is computed from the all-reduced output grad: already equal everywhere
    assert row.grad_sync_s == 0.0


def test_linear_batch_split_syncs_weight_and_bias_gradients():
    graph = mlp()
    batch = by_name(graph, "linear", (4,))["a"]
    assert batch.output == spec(shard(0))
    assert batch.inputs == (spec(shard(0)), None, None)
    assert dict(batch.params) == {"blocks.0.fc1.weight": spec(R), "blocks.0.fc1.bias": spec(R)}
    assert batch.comm_s == 0.0
    assert dict(batch.grad_sync_axes) == {"blocks.0.fc1.weight": (0,), "blocks.0.fc1.bias": (0,)}
    weight, bias = 64 * 64 * 4, 64 * 4  # fp32 gradients
    assert batch.grad_sync_s == pytest.approx(grad_sync_4(weight) + grad_sync_4(bias), rel=1e-12)
    mesh = context(graph, (4,)).mesh
    assert batch.grad_sync_s == pytest.approx(mesh.grad_sync_s(weight, 0) + mesh.grad_sync_s(bias, 0), rel=1e-12)
    # mixed precision: 2-byte gradients
    half = by_name(graph, "linear", (4,), grad_itemsize=2)["a"]
    assert half.grad_sync_s == pytest.approx(grad_sync_4(weight / 2) + grad_sync_4(bias / 2), rel=1e-12)


def test_linear_on_a_2d_mesh_combines_splits_in_both_axis_orders():
    graph = mlp()
    strategies = by_name(graph, "linear", (2, 4))
    row_scattered = {"k>0 -", "k>0 n", "- k>0", "n k>0"}  # one row split, its partial sum scattered along the tokens
    assert set(strategies) == {f"{a} {b}" for a in "-akn" for b in "-akn"} | row_scattered  # 8, 64, 64 divide by 2·4
    batch_column = strategies["a n"]
    assert batch_column.output == spec(shard(0), shard(1))
    assert batch_column.inputs == (spec(shard(0), R), None, None)
    assert dict(batch_column.params)["blocks.0.fc1.weight"] == spec(R, shard(0))
    assert dict(batch_column.grad_sync_axes)["blocks.0.fc1.weight"] == (0,)
    assert batch_column.compute_shards == 8
    column_batch = strategies["n a"]
    assert column_batch.output == spec(shard(1), shard(0))
    assert column_batch.inputs == (spec(R, shard(0)), None, None)
    assert dict(column_batch.params)["blocks.0.fc1.weight"] == spec(shard(0), R)
    assert dict(column_batch.grad_sync_axes)["blocks.0.fc1.weight"] == (1,)
    assert column_batch.compute_shards == 8
    batch_batch = strategies["a a"]
    assert batch_batch.output == spec(shard(0), shard(0))
    assert dict(batch_batch.grad_sync_axes)["blocks.0.fc1.weight"] == (0, 1)
    # batch over axis 0, row over axis 1: the partial sums are all-reduced over axis 1 only,
    # on the output local to axis 0 (2,048 / 2 bytes)
    batch_row = strategies["a k"]
    assert batch_row.output == spec(shard(0), R)
    assert batch_row.inputs == (spec(shard(0), shard(1)), None, None)
    assert batch_row.comm_s == pytest.approx(all_reduce_4(8 * 64 * 4 / 2), rel=1e-12)


def test_indivisible_splits_are_not_offered():
    graph = captured("mlp", 6, "export", **MLP)
    assert set(by_name(graph, "linear", (3,))) == {"-", "a"}  # 64 features do not split in 3
    two_d = by_name(graph, "linear", (2, 4))
    assert "a -" in two_d and "- a" not in two_d and "a a" not in two_d  # batch 6: by 2 only
    assert "a n" in two_d and "n a" not in two_d


# --- attention, embedding, convolution ------------------------------------------------------


def gpt() -> OpGraph:
    return captured("gpt", 8, "export")


def test_attention_splits_only_batch_and_heads():
    graph = gpt()
    node = graph.node("scaled_dot_product_attention")
    assert [m.shape for m in node.input_metas] == [(8, 4, 32, 16)] * 3
    strategies = by_name(graph, "scaled_dot_product_attention", (4,))
    assert set(strategies) == {"-", "b", "h"}
    for name, dim in (("b", 0), ("h", 1)):
        assert strategies[name].output == spec(shard(dim))
        assert strategies[name].inputs == (spec(shard(dim)),) * 3
        assert strategies[name].comm_s == 0.0
        assert strategies[name].compute_shards == 4
    assert set(by_name(graph, "scaled_dot_product_attention", (8,))) == {"-", "b"}  # 4 heads
    two_d = by_name(graph, "scaled_dot_product_attention", (2, 2))
    assert two_d["b h"].output == spec(shard(0), shard(1))
    assert two_d["h b"].inputs == (spec(shard(1), shard(0)),) * 3


def test_embedding_vocab_split_all_reduces_and_hidden_split_shards_the_output():
    graph = gpt()
    node = graph.node("embedding")
    assert node.inputs == ("wte.weight", "tokens") and node.output.shape == (8, 32, 64)
    strategies = by_name(graph, "embedding", (4,))
    assert set(strategies) == {"-", "a", "b", "h", "v", "v>1"}  # v>1: vocabulary split reduce-scattered along seq
    vocab = strategies["v"]
    assert vocab.output == spec(R)
    assert vocab.inputs == (None, spec(R))
    assert dict(vocab.params) == {"wte.weight": spec(shard(0))}
    assert vocab.comm_s == pytest.approx(all_reduce_4(8 * 32 * 64 * 4), rel=1e-12)  # partial sums
    assert vocab.grad_sync_s == 0.0
    hidden = strategies["h"]
    assert hidden.output == spec(shard(2))
    assert hidden.inputs == (None, spec(R))
    assert dict(hidden.params) == {"wte.weight": spec(shard(1))}
    assert hidden.comm_s == 0.0  # token ids have no gradient
    batch = strategies["a"]
    assert batch.inputs == (None, spec(shard(0))) and batch.output == spec(shard(0))
    assert batch.grad_sync_s == pytest.approx(grad_sync_4(512 * 64 * 4), rel=1e-12)


def resnet() -> OpGraph:
    return captured("resnet", 8, "export", **RESNET)


def test_convolution_splits_batch_out_and_in_channels():
    graph = resnet()
    node = graph.node("conv2d_1")
    assert [m.shape for m in node.input_metas] == [(8, 8, 32, 32), (8, 8, 3, 3)]
    strategies = by_name(graph, "conv2d_1", (4,))
    assert set(strategies) == {"-", "n", "o", "c"}
    activation = 8 * 8 * 32 * 32 * 4  # input and output alike
    out_channels = strategies["o"]
    assert out_channels.output == spec(shard(1))
    assert out_channels.inputs == (spec(R), None)
    assert dict(out_channels.params) == {"stages.0.0.conv1.weight": spec(shard(0))}
    assert out_channels.comm_s == pytest.approx(all_reduce_4(activation), rel=1e-12)  # input grad, backward
    in_channels = strategies["c"]
    assert in_channels.output == spec(R)
    assert in_channels.inputs == (spec(shard(1)), None)
    assert dict(in_channels.params) == {"stages.0.0.conv1.weight": spec(shard(1))}
    assert in_channels.comm_s == pytest.approx(all_reduce_4(activation), rel=1e-12)  # partial sums, forward
    batch = strategies["n"]
    assert batch.output == spec(shard(0)) and batch.inputs == (spec(shard(0)), None)
    assert batch.grad_sync_s == pytest.approx(grad_sync_4(8 * 8 * 3 * 3 * 4), rel=1e-12)
    stem = by_name(graph, "conv2d", (4,))  # 3 input channels
    assert set(stem) == {"-", "n", "o"}
    assert stem["o"].comm_s == 0.0  # the images need no gradient


def conv_graph(target: str, weight: tuple[int, ...], output: tuple[int, ...], *args: object, **kwargs: object):
    x = GraphValue(name="x", kind=ValueKind.INPUT, meta=TensorMeta(shape=(8, 16, 8, 8), dtype="float32"))
    w = GraphValue(name="w", kind=ValueKind.PARAM, meta=TensorMeta(shape=weight, dtype="float32"))
    node = OpNode(
        name="conv",
        target=target,
        kind=NodeKind.CONV,
        inputs=("x", "w"),
        input_metas=(x.meta, w.meta),
        outputs=(TensorMeta(shape=output, dtype="float32"),),
        params=("w",),
        args=(TensorArg(0), TensorArg(1), *args),
        kwargs=tuple(kwargs.items()),
    )
    return OpGraph(nodes=(node,), inputs=(x,), params=(w,))


def test_convolution_arguments_are_read_by_position():
    # dilation given, groups left at its default: an ordinary convolution
    dilated = conv_graph("aten.conv2d.default", (32, 16, 3, 3), (8, 32, 8, 8), None, (1, 1), (2, 2), (2, 2))
    assert set(by_name(dilated, "conv", (4,))) == {"-", "n", "o", "c"}
    # grouped, positionally (export) or by keyword (fx): not described by these letters
    for graph in (
        conv_graph("aten.conv2d.default", (32, 8, 3, 3), (8, 32, 6, 6), None, (1, 1), (0, 0), (1, 1), 2),
        conv_graph("torch.conv2d", (32, 8, 3, 3), (8, 32, 6, 6), groups=2),
    ):
        strategies, reason = enumerate_strategies(graph.node("conv"), context(graph, (4,)))
        assert [s.name for s in strategies] == ["-"] and reason is not None
    # transposed: the weight is [in, out, kh, kw], so "o"/"c" letters would mislabel it
    transposed = conv_graph("aten.conv_transpose2d.input", (16, 32, 3, 3), (8, 32, 10, 10))
    strategies, reason = enumerate_strategies(transposed.node("conv"), context(transposed, (4,)))
    assert [s.name for s in strategies] == ["-"] and reason is not None


# --- aligned operators ----------------------------------------------------------------------


def test_layer_norm_never_splits_the_normalized_dim():
    graph = gpt()
    layer_norms = [node.name for node in graph.nodes if node.op_name == "layer_norm"]
    assert len(layer_norms) == 5
    for shape in ((4,), (2, 2), (8,)):
        for name in layer_norms:
            for strategy in by_name(graph, name, shape).values():
                assert shard(2) not in strategy.output.placements, (name, strategy.name)
    strategies = by_name(graph, "layer_norm", (4,))
    assert set(strategies) == {"0", "1", "-", "1*"}  # 1*: on sequence shards, gathered for the linears reading it
    batch = strategies["0"]
    assert batch.inputs == (spec(shard(0)), None, None)
    assert dict(batch.params) == {"blocks.0.ln_1.weight": spec(R), "blocks.0.ln_1.bias": spec(R)}
    assert batch.grad_sync_s == pytest.approx(2 * grad_sync_4(64 * 4), rel=1e-12)


def test_group_norm_splits_only_the_batch():
    assert set(by_name(resnet(), "group_norm_1", (4,))) == {"-", "0"}


@pytest.mark.parametrize("tracer", ["export", "fx"])
def test_softmax_and_topk_never_split_their_dim(tracer):
    graph = captured("moe", 8, tracer, **MOE)
    # softmax over the 4 experts of (64, 4): 4 divides by 4, still not split
    assert set(by_name(graph, "softmax", (4,))) == {"-", "0"}
    # topk(probs, 2) over dim -1 of (64, 4): its first int argument is k, not the dim
    topk = by_name(graph, "topk", (2,))
    assert set(topk) == {"-", "0"}
    assert topk["0"].inputs == (spec(shard(0)),)
    for strategy in by_name(graph, "topk", (2, 2)).values():
        assert shard(1) not in strategy.output.placements


def test_broadcast_input_gradient_is_all_reduced():
    """x + wpe[:T] split on the batch: the (32, 64) position embedding is replicated and its
    gradient summed over the batch shards."""
    graph = gpt()
    node = graph.node("add")
    assert [m.shape for m in node.input_metas] == [(8, 32, 64), (32, 64)]
    strategies = by_name(graph, "add", (4,))
    assert set(strategies) == {"-", "0", "1", "2"}
    assert strategies["0"].inputs == (spec(shard(0)), spec(R))
    assert strategies["0"].comm_s == pytest.approx(all_reduce_4(32 * 64 * 4), rel=1e-12)
    assert strategies["1"].inputs == (spec(shard(1)), spec(shard(0)))
    assert strategies["1"].comm_s == 0.0


# --- MoE einsums ------------------------------------------------------------------------------


def moe() -> OpGraph:
    return captured("moe", 8, "export", **MOE)


def test_moe_einsums_split_the_expert_dim():
    graph = moe()
    assert graph.node("einsum").args[0] == "nd,edf->enf"
    up = by_name(graph, "einsum", (4,))["e"]
    assert up.output == spec(shard(0))
    assert up.inputs == (spec(R), None)
    assert dict(up.params) == {"blocks.0.w1": spec(shard(0))}
    assert up.comm_s == pytest.approx(all_reduce_4(64 * 32 * 4), rel=1e-12)  # tokens' grad, summed over experts
    assert up.grad_sync_s == 0.0
    down = by_name(graph, "einsum_1", (4,))["e"]  # enf,efd->end
    assert down.output == spec(shard(0)) and down.inputs == (spec(shard(0)), None)
    assert dict(down.params) == {"blocks.0.w2": spec(shard(0))}
    assert down.comm_s == 0.0
    combine = by_name(graph, "einsum_2", (4,))["e"]  # end,ne->nd: e is contracted
    assert combine.output == spec(R)
    assert combine.inputs == (spec(shard(0)), spec(shard(1)))
    assert combine.comm_s == pytest.approx(all_reduce_4(64 * 32 * 4), rel=1e-12)
