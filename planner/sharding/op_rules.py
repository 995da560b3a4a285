"""Which strategy family each operator belongs to, and its letters or excluded dims.

:func:`enumerate_strategies` is the entry point: contractions get einsum-style letters
(:func:`letters_for`), aligned operators the dims they work along (:func:`excluded_dims`),
views and reductions a dim map (:mod:`planner.sharding.view_rules`). An operator none of these
understands gets the single replicated strategy and a reason, which the caller reports.
Contractions and aligned operators also get Megatron sequence parallelism's variants
(:mod:`planner.sharding.sequence_parallel`).
"""

from __future__ import annotations

from planner.ir.graph import NodeKind, OpNode, TensorArg, ValueKind
from planner.sharding.sequence_parallel import (
    can_gather,
    gathered_input_variants,
    gathered_output_variants,
    reduce_scatter_variants,
)
from planner.sharding.strategies import (
    Letters,
    NodeStrategy,
    StrategyContext,
    aligned_strategies,
    contraction_strategies,
    replicated_strategy,
    tensor_positions,
)
from planner.sharding.view_rules import view_dim_map, view_strategies

_LEAD = "abcdefg"


def _tensor_words(node: OpNode, words_by_position: dict[int, str]) -> tuple[str | None, ...] | None:
    """Letters per entry of ``node.inputs`` from letters per positional argument."""
    positions = tensor_positions(node)
    words: list[str | None] = [None] * len(node.inputs)
    for position, index in positions.items():
        word = words_by_position.get(position)
        if word is None or len(word) != len(node.input_metas[index].shape):
            return None
        words[index] = word
    return tuple(words)


def _linear_letters(node: OpNode) -> Letters | None:
    rank = len(node.input_metas[0].shape)
    lead = _LEAD[: rank - 1]
    words = _tensor_words(node, {0: lead + "k", 1: "nk", 2: "n"})
    return Letters(inputs=words, output=lead + "n", splittable=frozenset(lead + "nk")) if words else None


def _matmul_letters(node: OpNode) -> Letters | None:
    name = node.op_name
    if name == "mm":
        words = _tensor_words(node, {0: "mk", 1: "kn"})
        return Letters(inputs=words, output="mn", splittable=frozenset("mnk")) if words else None
    if name == "addmm":
        bias_rank = len(node.input_metas[tensor_positions(node)[0]].shape)
        words = _tensor_words(node, {0: "mn"[2 - bias_rank :], 1: "mk", 2: "kn"})
        return Letters(inputs=words, output="mn", splittable=frozenset("mnk")) if words else None
    if name == "bmm":
        words = _tensor_words(node, {0: "bmk", 1: "bkn"})
        return Letters(inputs=words, output="bmn", splittable=frozenset("bmnk")) if words else None
    if name == "matmul":
        left, right = (len(meta.shape) for meta in node.input_metas[:2])
        if right == 2:
            lead = _LEAD[: left - 1]
            words = _tensor_words(node, {0: lead + "k", 1: "kn"})
            return Letters(inputs=words, output=lead + "n", splittable=frozenset(lead + "kn")) if words else None
        if left == right >= 3:
            lead = _LEAD[: left - 2]
            words = _tensor_words(node, {0: lead + "mk", 1: lead + "kn"})
            return Letters(inputs=words, output=lead + "mn", splittable=frozenset(lead + "mnk")) if words else None
    if name == "einsum":
        return _einsum_letters(node)
    return None


def _einsum_letters(node: OpNode) -> Letters | None:
    equation = node.args[0] if node.args and isinstance(node.args[0], str) else None
    operands = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], tuple) else node.args[1:]
    if equation is None or "..." in equation or "->" not in equation:
        return None
    sources, output = equation.replace(" ", "").split("->")
    words: list[str | None] = [None] * len(node.inputs)
    for word, operand in zip(sources.split(","), operands, strict=False):
        if not isinstance(operand, TensorArg) or len(word) != len(node.input_metas[operand.index].shape):
            return None
        words[operand.index] = word
    return Letters(inputs=tuple(words), output=output, splittable=frozenset(sources.replace(",", "") + output))


def _conv_letters(node: OpNode) -> Letters | None:
    if node.op_name.startswith("conv_transpose"):
        return None  # weight is [in, out/groups, ...]: the letters below do not describe it
    # conv{1,2,3}d(input, weight, bias, stride, padding, dilation, groups);
    # convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    position = 8 if node.op_name in ("convolution", "_convolution") else 6
    groups = dict(node.kwargs).get("groups", node.args[position] if len(node.args) > position else 1)
    if node.op_name in ("convolution", "_convolution"):
        transposed = dict(node.kwargs).get("transposed", node.args[6] if len(node.args) > 6 else False)
        if transposed:
            return None
    if groups != 1:
        return None
    spatial = len(node.input_metas[0].shape) - 2
    words = _tensor_words(node, {0: "nc" + "xyz"[:spatial], 1: "oc" + "ijl"[:spatial], 2: "o"})
    return Letters(inputs=words, output="no" + "XYZ"[:spatial], splittable=frozenset("noc")) if words else None


def _embedding_letters(node: OpNode) -> Letters | None:
    metas = node.input_metas
    weight = next((i for i, m in enumerate(metas) if m.is_floating and len(m.shape) == 2), None)
    indices = next((i for i, m in enumerate(metas) if not m.is_floating), None)
    if weight is None or indices is None:
        return None
    lead = _LEAD[: len(metas[indices].shape)]
    words: list[str | None] = [None] * len(node.inputs)
    words[weight], words[indices] = "vh", lead
    return Letters(inputs=tuple(words), output=lead + "h", splittable=frozenset(lead + "vh"))


def _attention_letters(node: OpNode) -> Letters | None:
    if any(len(meta.shape) != 4 for meta in node.input_metas[:3]):
        return None
    words: list[str | None] = ["bhtd", "bhsd", "bhsd"]
    for meta in node.input_metas[3:]:
        words.append("bhts"[4 - len(meta.shape) :] if len(meta.shape) <= 4 else None)
    return Letters(inputs=tuple(words), output="bhtd", splittable=frozenset("bh"))


def letters_for(node: OpNode) -> Letters | None:
    if node.kind == NodeKind.MATMUL:
        return _linear_letters(node) if node.op_name in ("linear", "_linear") else _matmul_letters(node)
    if node.kind == NodeKind.CONV:
        return _conv_letters(node)
    if node.kind == NodeKind.EMBEDDING and node.op_name == "embedding":
        return _embedding_letters(node)
    if node.kind == NodeKind.ATTENTION:
        return _attention_letters(node)
    return None


def _dim_arg(node: OpNode, default: int | None) -> int | None:
    for key, value in node.kwargs:
        if key == "dim" and isinstance(value, int):
            return value
    ints = [arg for arg in node.args[1:] if isinstance(arg, int) and not isinstance(arg, bool)]
    return ints[0] if ints else default


def excluded_dims(node: OpNode) -> set[int] | None:
    """Dims an aligned operator works along (cannot split), or None if it is not aligned."""
    rank = len(node.output.shape)
    name = node.op_name
    if node.kind == NodeKind.ELEMENTWISE or (node.kind == NodeKind.CREATION and node.inputs and name != "arange"):
        return {rank - 2, rank - 1} if name in ("tril", "triu") else set()
    if node.kind == NodeKind.NORM:
        if name in ("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"):
            shape = next((arg for arg in node.args[1:] if isinstance(arg, tuple)), (0,))
            return set(range(rank - len(shape), rank))
        return set(range(1, rank)) if name in ("group_norm", "native_group_norm") else set(range(rank))
    if node.kind == NodeKind.SOFTMAX:
        return {_dim_arg(node, -1) % rank}
    if node.kind == NodeKind.POOL:
        return set(range(2, rank))
    if node.kind == NodeKind.INDEX and name in ("topk", "sort", "cat", "gather", "scatter", "scatter_add"):
        if name == "topk":  # topk(input, k, dim=-1, ...): the first int is k
            dim = dict(node.kwargs).get("dim", node.args[2] if len(node.args) > 2 else -1)
        elif name in ("gather", "scatter", "scatter_add"):
            dim = node.args[1]
        else:
            dim = _dim_arg(node, 0 if name == "cat" else -1)
        return {int(dim) % rank} if rank else None
    return None


def _reduction_map(node: OpNode) -> list[int | None] | None:
    source, target = node.input_metas[0].shape, node.output.shape
    if len(target) == len(source):
        return [d if source[d] == target[d] else None for d in range(len(target))]
    dims = dict(node.kwargs).get("dim")  # fx keeps Tensor.sum(dim=1) as a keyword
    if dims is None:
        dims = next((arg for arg in node.args[1:] if isinstance(arg, int | tuple) and not isinstance(arg, bool)), None)
    if dims is None or not target:
        return None
    reduced = {d % len(source) for d in (dims if isinstance(dims, tuple | list) else (dims,))}
    kept = [d for d in range(len(source)) if d not in reduced]
    return kept if len(kept) == len(target) else None


def enumerate_strategies(node: OpNode, context: StrategyContext) -> tuple[list[NodeStrategy], str | None]:
    """All strategies of ``node``; the replicated one alone, with a reason, when not understood."""
    letters = (
        letters_for(node)
        if node.kind in (NodeKind.MATMUL, NodeKind.CONV, NodeKind.EMBEDDING, NodeKind.ATTENTION)
        else None
    )
    strategies: list[NodeStrategy] = []
    if letters is not None:
        strategies = contraction_strategies(node, letters, context)
        strategies += reduce_scatter_variants(node, letters, strategies, context)
        strategies += gathered_input_variants(node, _gathering_inputs(node, context), strategies, context)
    elif node.kind == NodeKind.VIEW or node.op_name in ("argmax", "argmin"):  # op_kinds files these under INDEX
        dim_map = view_dim_map(node) if node.kind == NodeKind.VIEW else _reduction_map(node)
        strategies = view_strategies(node, dim_map, context) if dim_map is not None else []
    elif node.kind == NodeKind.REDUCTION:
        dim_map = _reduction_map(node)
        strategies = view_strategies(node, dim_map, context) if dim_map is not None else []
    elif (excluded := excluded_dims(node)) is not None:
        strategies = aligned_strategies(node, excluded, context)
        if _read_by_contraction(node.name, context) and can_gather(node, excluded, context):
            strategies += gathered_output_variants(node, strategies, context)
    if strategies:
        return strategies, None
    reason = None if node.kind in (NodeKind.CREATION, NodeKind.REDUCTION) else f"no sharding rule for {node.target}"
    return [replicated_strategy(node, context)], reason


def _read_by_contraction(value: str, context: StrategyContext) -> bool:
    graph = context.graph
    return any(
        graph.node(reader).kind == NodeKind.MATMUL and letters_for(graph.node(reader)) is not None
        for reader in context.readers.get(value, ())
    )


def _gathering_inputs(node: OpNode, context: StrategyContext) -> list[int]:
    """Positions of ``node``'s activation inputs made by an operator that may gather them (sequence parallelism)."""
    if node.kind != NodeKind.MATMUL:
        return []
    graph, positions = context.graph, []
    for position, name in enumerate(node.inputs):
        if graph.value_kind(name) != ValueKind.NODE or name in node.inputs[:position]:
            continue
        producer = graph.node(name)
        excluded = excluded_dims(producer)
        if excluded is not None and can_gather(producer, excluded, context):
            positions.append(position)
    return positions


_ROLES: dict[NodeKind, dict[str, str]] = {
    NodeKind.MATMUL: {"a": "batch", "b": "seq", "n": "col", "k": "row"},
    NodeKind.EMBEDDING: {"a": "batch", "b": "seq", "v": "vocab", "h": "hidden"},
    NodeKind.ATTENTION: {"b": "batch", "h": "heads"},
    NodeKind.CONV: {"n": "batch", "o": "out-ch", "c": "in-ch"},
}


def split_label(node: OpNode, strategy_name: str) -> str:
    """A strategy's per-axis splits in words: ``"a n"`` on a linear reads ``"batch col"``."""
    roles = _ROLES.get(node.kind, {}) if letters_for(node) is not None else {}
    letters = letters_for(node)
    words = []
    for choice in strategy_name.split(" "):
        choice, gathered = choice.removesuffix("*"), choice.endswith("*")  # reads or writes a gathered R* tensor
        choice, _, scattered = choice.partition(">")  # a partial sum reduce-scattered to dim `scattered`
        if choice == "-":
            word = "-"
        elif choice.isdigit():
            word = f"dim{choice}"
        else:
            word = roles.get(choice, choice)
        if scattered and letters is not None:
            letter = letters.output[int(scattered)]
            word += f"→{roles.get(letter, letter)}"
        words.append(word + ("*" if gathered else ""))
    return " ".join(words)
