"""How a split moves through a view: output dim -> the input dim holding the same elements.

:func:`view_dim_map` returns, for each output dim, the input dim whose split by ``n`` is the
output dim's split by ``n`` (or None when no input split gives it). Reshapes pair the leading
dims of each group of dims whose sizes multiply to the same product; transposes and permutes
reorder; unsqueeze/squeeze/select/slice/expand insert, drop or pin dims.
:func:`view_strategies` turns the map into strategies (splits valid on both sides).
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.ir.graph import OpNode, TensorArg
from planner.sharding.specs import REPLICATE, ShardingSpec, shard
from planner.sharding.strategies import NodeStrategy, StrategyContext, _finish, axis_choices

_IDENTITY = frozenset(
    {
        "clone",
        "contiguous",
        "detach",
        "alias",
        "_to_copy",
        "to",
        "float",
        "half",
        "bfloat16",
        "type_as",
        "lift_fresh_copy",
        "getitem",
    }
)
_RESHAPE = frozenset({"view", "_unsafe_view", "reshape", "flatten", "unflatten", "view_as"})


def _norm(dim: int, rank: int) -> int:
    return dim % rank if rank else 0


# The leading non-tensor parameters each view's rule reads, to find them when passed by keyword.
_SCALAR_PARAMS = {
    "transpose": ("dim0", "dim1"),
    "permute": ("dims",),
    "unsqueeze": ("dim",),
    "slice": ("dim",),
    "select": ("dim",),
    "narrow": ("dim",),
}


def _scalar_args(node: OpNode) -> list[object]:
    """Non-tensor arguments in order, the ones fx kept as keywords appended by name."""
    scalars = [arg for arg in node.args if not isinstance(arg, TensorArg)]
    kwargs = dict(node.kwargs)
    for name in _SCALAR_PARAMS.get(node.op_name, ())[len(scalars) :]:
        if name not in kwargs:
            break
        scalars.append(kwargs[name])
    return scalars


def reshape_map(source: Sequence[int], target: Sequence[int]) -> list[int | None]:
    """Leading dims of matching product groups correspond; other dims of a group do not."""
    result: list[int | None] = [None] * len(target)
    i = j = 0
    while i < len(source) and j < len(target):
        group_i, group_j = [i], [j]
        product_i, product_j = source[i], target[j]
        while product_i != product_j:
            if product_i < product_j:
                i += 1
                if i >= len(source):
                    return result
                group_i.append(i)
                product_i *= source[i]
            else:
                j += 1
                if j >= len(target):
                    return result
                group_j.append(j)
                product_j *= target[j]
        first_i = next((k for k in group_i if source[k] != 1), group_i[0])
        first_j = next((k for k in group_j if target[k] != 1), group_j[0])
        result[first_j] = first_i
        i, j = i + 1, j + 1
    return result


def view_dim_map(node: OpNode) -> list[int | None] | None:
    """Output dim -> input dim, or None when this view is not understood."""
    name = node.op_name
    source = node.input_metas[0].shape if node.input_metas else ()
    target = node.output.shape
    rank_in, rank_out = len(source), len(target)
    if name in _IDENTITY:
        return list(range(rank_out)) if source == target else None
    if name in _RESHAPE:
        return reshape_map(source, target)
    scalars = _scalar_args(node)
    if name in ("transpose", "t"):
        if rank_in < 2:
            return list(range(rank_out))  # t() of a vector is the vector
        first, second = (0, 1) if name == "t" else (_norm(int(scalars[0]), rank_in), _norm(int(scalars[1]), rank_in))
        order = list(range(rank_in))
        order[first], order[second] = order[second], order[first]
        return list(order)
    if name == "permute":  # permute(dims) or, as fx records Tensor.permute(0, 2, 1), permute(*dims)
        dims = scalars[0] if scalars and isinstance(scalars[0], tuple | list) else scalars
        return [_norm(int(d), rank_in) for d in dims]
    if name == "unsqueeze":
        dim = _norm(int(scalars[0]), rank_out)
        return [None if d == dim else (d if d < dim else d - 1) for d in range(rank_out)]
    if name in ("expand", "expand_as"):
        offset = rank_out - rank_in
        return [d - offset if d >= offset and source[d - offset] == target[d] else None for d in range(rank_out)]
    if name in ("slice", "select", "narrow", "squeeze"):
        return _drop_or_pin(name, scalars, source, target)
    return None


def _drop_or_pin(
    name: str, scalars: list[object], source: Sequence[int], target: Sequence[int]
) -> list[int | None] | None:
    if name == "squeeze":
        kept = [d for d, size in enumerate(source) if size != 1]
        return kept if len(kept) == len(target) else None
    dim = _norm(int(scalars[0]) if scalars else 0, len(source))
    if name == "select":
        return [d if d < dim else d + 1 for d in range(len(target))]
    return [None if d == dim and source[d] != target[d] else d for d in range(len(target))]


def view_strategies(node: OpNode, dim_map: list[int | None], context: StrategyContext) -> list[NodeStrategy]:
    mesh = context.mesh
    source = node.input_metas[0].shape
    candidates = [d for d, origin in enumerate(dim_map) if origin is not None and node.output.shape[d] > 1]
    strategies = []
    for assignment in axis_choices(candidates, mesh.num_axes):
        output = ShardingSpec(tuple(REPLICATE if d is None else shard(d) for d in assignment))
        first = ShardingSpec(tuple(REPLICATE if d is None else shard(dim_map[d]) for d in assignment))
        if not output.fits(node.output.shape, mesh.mesh_shape) or not first.fits(source, mesh.mesh_shape):
            continue
        # Later tensor arguments (view_as/expand_as/type_as's ``other``) give only a shape or
        # dtype: no layout is needed and no gradient flows back to them.
        others = [None] * (len(node.inputs) - 1)
        strategies.append(
            _finish(node, assignment, output, [first, *others], 0.0, context, context.graph, contracted=set())
        )
    return strategies
