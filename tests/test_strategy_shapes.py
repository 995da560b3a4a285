"""How per-operator sharding strategies follow shapes (planner.sharding.view_rules, planner.sharding.op_rules):
views and reshapes map the dims they keep, reductions and index operators never split the dims they consume,
an operator without a rule is replicated with a reason, and every strategy of every example fits its shapes
with sane costs. The operator rules themselves (linear, attention, convolution, norms, einsums) are
``tests/test_strategies.py``.
"""

from __future__ import annotations

import math

import pytest

from planner.costing.node_cost import grad_values
from planner.ir.graph import GraphValue, NodeKind, OpGraph, OpNode, TensorArg, TensorMeta, ValueKind
from planner.ir.op_kinds import classify
from planner.sharding.op_rules import enumerate_strategies
from planner.sharding.specs import REPLICATE, ShardingSpec, shard
from planner.sharding.view_rules import reshape_map, view_dim_map
from tests.conftest import by_name, captured, context

R = REPLICATE

MOE = {"hidden": 32, "tokens": 8, "ffn": 64}
EXAMPLES = {"mlp": {"hidden": 64, "layers": 2}, "gpt": {}, "resnet": {"width": 8}, "moe": MOE}  # gpt: the tiny size


def spec(*placements: str) -> ShardingSpec:
    return ShardingSpec(tuple(placements))


def test_view_as_reads_only_the_shape_of_its_second_argument():
    """out.view_as(x): x gets no gradient from it and needs no particular layout."""
    graph = captured("moe", 8, "export", **MOE)
    node = graph.node("view_as_1")
    assert node.inputs == ("einsum_5", "add") and "add" in grad_values(graph)
    strategies = by_name(graph, "view_as_1", (2, 2))
    assert strategies["0 -"].output == spec(shard(0), R)
    assert strategies["0 -"].inputs == (spec(shard(0), R), None)
    for strategy in strategies.values():
        assert strategy.inputs[1] is None
        assert strategy.comm_s == 0.0


# --- views ---------------------------------------------------------------------------------


def test_reshape_map_hand_cases():
    assert reshape_map((2, 3, 4), (6, 4)) == [0, 2]
    assert reshape_map((6, 4), (2, 3, 4)) == [0, None, 1]
    assert reshape_map((8, 16, 64), (8, 16, 4, 16)) == [0, 1, 2, None]
    assert reshape_map((8, 16, 4, 16), (8, 16, 64)) == [0, 1, 2]
    assert reshape_map((8, 32, 1, 1), (8, 32)) == [0, 1]
    assert reshape_map((8, 1, 32), (8, 32)) == [0, 2]  # the size-1 dim leads no group
    assert reshape_map((8, 32), (8, 1, 32)) == [0, None, 1]
    assert reshape_map((4, 6), (6, 4)) == [0, None]  # one group: only the leading dims pair up


def view_node(target: str, source: tuple[int, ...], target_shape: tuple[int, ...], *args, **kwargs) -> OpNode:
    return OpNode(
        name="v",
        target=target,
        kind=NodeKind.VIEW,
        inputs=("x",),
        input_metas=(TensorMeta(shape=source, dtype="float32"),),
        outputs=(TensorMeta(shape=target_shape, dtype="float32"),),
        args=(TensorArg(0), *args),
        kwargs=tuple(kwargs.items()),
    )


def test_view_dim_maps_of_transpose_permute_and_friends():
    assert view_dim_map(view_node("aten.transpose.int", (8, 32, 4, 16), (8, 4, 32, 16), 1, 2)) == [0, 2, 1, 3]
    assert view_dim_map(view_node("aten.transpose.int", (8, 32, 4), (8, 4, 32), -1, -2)) == [0, 2, 1]
    assert view_dim_map(view_node("aten.t.default", (3, 5), (5, 3))) == [1, 0]
    assert view_dim_map(view_node("aten.t.default", (5,), (5,))) == [0]
    assert view_dim_map(view_node("aten.permute.default", (2, 3, 4), (4, 2, 3), (2, 0, 1))) == [2, 0, 1]
    assert view_dim_map(view_node("Tensor.permute", (2, 3, 4), (4, 2, 3), 2, 0, 1)) == [2, 0, 1]  # fx: *dims
    assert view_dim_map(view_node("aten.unsqueeze.default", (8, 4), (8, 1, 4), 1)) == [0, None, 1]
    assert view_dim_map(view_node("Tensor.unsqueeze", (8, 4), (8, 4, 1), dim=-1)) == [0, 1, None]  # fx keyword
    assert view_dim_map(view_node("aten.select.int", (8, 3, 4), (8, 4), 1, 0)) == [0, 2]
    assert view_dim_map(view_node("aten.slice.Tensor", (32, 64), (16, 64), 0, 0, 16)) == [None, 1]
    assert view_dim_map(view_node("aten.expand.default", (1, 4), (8, 3, 4), (8, 3, 4))) == [None, None, 1]


def test_gpt_head_split_view_exists_only_when_heads_divide():
    graph = captured("gpt", 8, "export")
    node = graph.node("view")
    assert node.input_metas[0].shape == (8, 32, 64) and node.output.shape == (8, 32, 4, 16)
    four = by_name(graph, "view", (4,))
    assert set(four) == {"-", "0", "1", "2"}  # never the head_dim (3)
    assert four["2"].output == spec(shard(2)) and four["2"].inputs == (spec(shard(2)),)
    eight = by_name(graph, "view", (8,))  # 64 divides by 8, 4 heads do not
    assert set(eight) == {"-", "0", "1"}
    assert all(shard(2) not in s.inputs[0].placements for s in eight.values())
    two_d = by_name(graph, "view", (2, 2))
    assert two_d["2 2"].output == spec(shard(2), shard(2)) and two_d["2 2"].inputs == (spec(shard(2), shard(2)),)
    transpose = by_name(graph, "transpose", (4,))  # (8, 32, 4, 16) -> (8, 4, 32, 16)
    assert transpose["1"].inputs == (spec(shard(2)),)
    assert transpose["2"].inputs == (spec(shard(1)),)
    merge = by_name(graph, "reshape", (4,))  # (8, 32, 4, 16) -> (8, 32, 64)
    assert merge["2"].inputs == (spec(shard(2)),)


def test_fx_keyword_and_vararg_views_and_reductions():
    x = GraphValue(name="x", kind=ValueKind.INPUT, meta=TensorMeta(shape=(4, 8, 16), dtype="float32"))
    permute = view_node("Tensor.permute", (4, 8, 16), (4, 16, 8), 0, 2, 1)
    total = OpNode(
        name="total",
        target="Tensor.sum",
        kind=NodeKind.REDUCTION,
        inputs=("x",),
        input_metas=(x.meta,),
        outputs=(TensorMeta(shape=(4, 16), dtype="float32"),),
        args=(TensorArg(0),),
        kwargs=(("dim", 1),),
    )
    graph = OpGraph(nodes=(permute, total), inputs=(x,), params=())
    views = by_name(graph, "v", (2,))
    assert views["1"].output == spec(shard(1)) and views["1"].inputs == (spec(shard(2)),)
    sums = by_name(graph, "total", (2,))
    assert set(sums) == {"-", "0", "1"}
    assert sums["1"].inputs == (spec(shard(2)),)  # the summed dim 1 is never split


def test_argmax_keeps_the_dims_it_does_not_reduce():
    probs = TensorMeta(shape=(64, 4), dtype="float32")
    assert classify("argmax", (probs,), (TensorMeta(shape=(64,), dtype="int64"),)) == NodeKind.INDEX
    x = GraphValue(name="x", kind=ValueKind.INPUT, meta=probs)
    argmax = OpNode(
        name="argmax",
        target="aten.argmax.default",
        kind=NodeKind.INDEX,
        inputs=("x",),
        input_metas=(probs,),
        outputs=(TensorMeta(shape=(64,), dtype="int64"),),
        args=(TensorArg(0), -1),
    )
    graph = OpGraph(nodes=(argmax,), inputs=(x,), params=())
    strategies = by_name(graph, "argmax", (2,))
    assert set(strategies) == {"-", "0"}
    assert strategies["0"].inputs == (spec(shard(0)),)


# --- operators without a rule ---------------------------------------------------------------


def test_operator_without_a_rule_is_replicated_with_a_reason():
    x = GraphValue(name="x", kind=ValueKind.INPUT, meta=TensorMeta(shape=(8, 16), dtype="float32"))
    w = GraphValue(name="w", kind=ValueKind.PARAM, meta=TensorMeta(shape=(16,), dtype="float32"))
    mystery = OpNode(
        name="mystery",
        target="aten.some_unknown.default",
        kind=NodeKind.OTHER,
        inputs=("x", "w"),
        input_metas=(x.meta, w.meta),
        outputs=(TensorMeta(shape=(8, 16), dtype="float32"),),
        params=("w",),
        args=(TensorArg(0), TensorArg(1)),
    )
    moved = view_node("aten.movedim.int", (8, 16), (16, 8), 0, 1)
    graph = OpGraph(nodes=(mystery, moved), inputs=(x,), params=(w,))
    for shape in ((4,), (2, 2)):
        strategies, reason = enumerate_strategies(mystery, context(graph, shape))
        assert reason == "no sharding rule for aten.some_unknown.default"
        (only,) = strategies
        replicated = ShardingSpec.replicated(len(shape))
        assert only.output == replicated and only.inputs == (replicated, None)
        assert dict(only.params) == {"w": replicated}
        assert only.compute_shards == 1 and only.comm_s == 0.0 and only.grad_sync_s == 0.0
    strategies, reason = enumerate_strategies(moved, context(graph, (4,)))
    assert len(strategies) == 1 and reason == "no sharding rule for aten.movedim.int"


# --- every strategy of every example ---------------------------------------------------------

SHAPE_ONLY = {"view_as", "expand_as", "type_as"}


@pytest.mark.parametrize("tracer", ["export", "fx"])
@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_every_strategy_fits_its_shapes_and_costs_are_sane(example, tracer):
    graph = captured(example, 8, tracer, **EXAMPLES[example])
    for shape in ((4,), (2, 2)):
        ctx = context(graph, shape)
        replicated = ShardingSpec.replicated(len(shape))
        for node in graph.nodes:
            strategies, _ = enumerate_strategies(node, ctx)
            where = f"{example}/{tracer} {shape} {node.name} ({node.target})"
            names = [s.name for s in strategies]
            assert strategies and len(names) == len(set(names)), where
            assert any(s.output == replicated for s in strategies), f"{where}: no replicated strategy"
            metas = dict(zip(node.inputs, node.input_metas, strict=True))
            node_params = {n for n in node.inputs if graph.value_kind(n) == ValueKind.PARAM}
            for s in strategies:
                at = f"{where} [{s.name}]"
                assert s.output.fits(node.output.shape, shape), at
                assert len(s.inputs) == len(node.inputs), at
                for name, meta, need in zip(node.inputs, node.input_metas, s.inputs, strict=True):
                    if need is None:
                        assert graph.value_kind(name) in (ValueKind.PARAM, ValueKind.BUFFER) or (
                            node.op_name in SHAPE_ONLY
                        ), f"{at}: no spec for {name}"
                    else:
                        assert len(need.placements) == len(shape), at
                        assert need.fits(meta.shape, shape), f"{at}: {name} {meta.shape} as {need}"
                params = dict(s.params)
                assert set(params) == node_params, at
                for name, placement in params.items():
                    assert placement.fits(metas[name].shape, shape), f"{at}: {name} {metas[name].shape} as {placement}"
                    for axis in dict(s.grad_sync_axes).get(name, ()):
                        assert placement.placements[axis] == REPLICATE, f"{at}: {name} synced over a split axis"
                assert s.compute_shards >= 1, at
                assert s.compute_shards <= math.prod(shape), at
                for cost in (s.comm_s, s.grad_sync_s):
                    assert math.isfinite(cost) and cost >= 0.0, at
                specs = [s.output, *(i for i in s.inputs if i is not None), *params.values()]
                if all(spec == replicated for spec in specs):
                    assert s.comm_s == 0.0 and s.grad_sync_s == 0.0 and s.compute_shards == 1, at
