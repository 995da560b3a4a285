"""Megatron sequence parallelism as strategies the intra-op ILP chooses per node.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4.2.2:
tensor parallelism leaves the operators between a row-parallel and the next column-parallel linear
(dropout, residual add, layer norm) whole on every device of the tensor axis; sequence parallelism
splits them along the sequence and swaps the collectives around them — ``ḡ`` after the row-parallel
linear is a reduce-scatter forward and an all-gather backward instead of an all-reduce, ``g`` before
the column-parallel linear an all-gather forward and a reduce-scatter backward instead of an
all-reduce backward. On a ring a reduce-scatter plus an all-gather move what one all-reduce moves
(:mod:`cost_models.communication`), so the swap costs no time, while the norms, dropouts and adds
compute 1/t of the work and keep 1/t of their activations (and dropout masks).

The *sequence dim* of a tensor is its dim ``rank − 2`` (``[batch, seq, hidden]``: 1; ``[tokens,
hidden]``: 0). Three kinds of variant, each a strategy of the generic rules
(:mod:`planner.sharding.strategies`) with its collectives changed and priced again by
:func:`~planner.sharding.strategies.own_collectives_s` (the function a stored record is priced with),
on mesh axis ``a`` of ``t > 1`` devices, ``b`` the bytes of the tensor local to the other axes:

* ``ḡ`` — :func:`reduce_scatter_variants`: a contraction whose split letter ``ℓ`` is contracted on
  ``a`` (a partial sum) scatters its output along the sequence instead of all-reducing it: output
  ``S(seq)`` on ``a``; ``reduce_scatter(b) forward + all_gather(b) backward`` (of the output's
  gradient) replace ``all_reduce(b)``. Name token ``ℓ>d``.
* ``g`` at the producer — :func:`gathered_output_variants`: an aligned operator computed on sequence
  shards on ``a`` gathers its output there: output ``R*`` on ``a``
  (:data:`~planner.sharding.specs.GATHERED`); ``all_gather(b) forward + reduce_scatter(b) backward``
  (of the partial gradients its readers hand back). Offered where a contraction reads the output. All
  readers share the one gathered tensor (GPT's ``q``, ``k`` and ``v`` read one layer norm's output),
  as Megatron's fused QKV linear does. Name token ``d*``.
* ``g`` at the reader — :func:`gathered_input_variants`: a column-parallel contraction (an activation
  replicated on an axis it splits) reads that activation ``R*``: it hands the partial gradient back
  and drops its own backward ``all_reduce(b)``; the edge prices the rest
  (:func:`planner.sharding.specs.reshard_s`: nothing from a gathered producer, the same all-reduce
  from any other). Offered where the activation comes from an operator that can gather. Name token ``ℓ*``.

Memory is each node's output at its spec, as for any strategy (:mod:`planner.costing.node_cost`): the
sequence-split operators keep 1/t, a gathered output is whole once, for all its readers (torch's
autograd keeps the linear's gathered input; Megatron-LM instead keeps the shard and gathers it again in
backward). :func:`computed_output` is the spec a node computes its output in before its own output
collectives, which is what its kernel's shape and a dropout's mask follow.
"""

from __future__ import annotations

from dataclasses import replace

from planner.ir.graph import OpNode, ValueKind
from planner.sharding.specs import GATHERED, REPLICATE, ShardingSpec, shard
from planner.sharding.strategies import Letters, NodeStrategy, StrategyContext, own_collectives_s


def sequence_dim(node: OpNode) -> int | None:
    """The output's sequence dim (``rank − 2``), None below rank 2."""
    rank = len(node.output.shape)
    return rank - 2 if rank >= 2 else None


def _with_token(name: str, axis: int, token: str) -> str:
    tokens = name.split(" ")
    tokens[axis] = token
    return " ".join(tokens)


def _priced(node: OpNode, strategy: NodeStrategy, context: StrategyContext) -> NodeStrategy:
    comm_s = own_collectives_s(
        node, strategy.collectives, output=strategy.output, operands=strategy.operands, mesh=context.mesh
    )
    return replace(strategy, comm_s=comm_s)


def reduce_scatter_variants(
    node: OpNode, letters: Letters, base: list[NodeStrategy], context: StrategyContext
) -> list[NodeStrategy]:
    """``ḡ``: each strategy with one contracted axis, its all-reduce made a reduce-scatter along the sequence."""
    seq, mesh = sequence_dim(node), context.mesh
    if seq is None:
        return []
    seq_letter = letters.output[seq]
    activations = [
        word
        for name, word in zip(node.inputs, letters.inputs, strict=True)
        if word is not None and context.graph.value_kind(name) != ValueKind.PARAM
    ]
    if not any(seq_letter in word for word in activations):  # the output's dim must come from the activations
        return []
    variants = []
    for strategy in base:
        tokens = strategy.name.split(" ")
        contracted = [axis for axis, token in enumerate(tokens) if token != "-" and token not in letters.output]
        if len(contracted) != 1 or seq_letter in tokens or mesh.mesh_shape[contracted[0]] == 1:
            continue
        axis = contracted[0]
        output = strategy.output.with_placement(axis, shard(seq))
        if not output.fits(node.output.shape, mesh.mesh_shape):
            continue
        partial = ("all_reduce", axis, "forward", None)
        collectives = [("reduce_scatter", axis, "forward", None) if c == partial else c for c in strategy.collectives]
        if node.name in context.grad_values:
            collectives.append(("all_gather", axis, "backward", None))
        variant = replace(
            strategy,
            name=_with_token(strategy.name, axis, f"{tokens[axis]}>{seq}"),
            output=output,
            collectives=tuple(collectives),
        )
        variants.append(_priced(node, variant, context))
    return variants


def can_gather(node: OpNode, excluded: set[int], context: StrategyContext) -> bool:
    """An aligned operator (working along ``excluded``) that may compute on sequence shards and gather its output."""
    seq = sequence_dim(node)
    return (
        seq is not None
        and seq not in {d % len(node.output.shape) for d in excluded}
        and len(node.outputs) == 1
        and node.output.is_floating
        and node.name in context.grad_values
        and any(size > 1 and node.output.shape[seq] % size == 0 for size in context.mesh.mesh_shape)
    )


def gathered_output_variants(node: OpNode, base: list[NodeStrategy], context: StrategyContext) -> list[NodeStrategy]:
    """``g`` at the producer: each strategy computing sequence shards on one axis alone, its output gathered there."""
    seq, mesh = sequence_dim(node), context.mesh
    variants = []
    for strategy in base:
        for axis, placement in enumerate(strategy.output.placements):
            if placement != shard(seq) or strategy.output.shards_per_dim(mesh.mesh_shape)[seq] != mesh.mesh_shape[axis]:
                continue
            if mesh.mesh_shape[axis] == 1:
                continue
            collectives = (
                *strategy.collectives,
                ("all_gather", axis, "forward", None),
                ("reduce_scatter", axis, "backward", None),
            )
            variant = replace(
                strategy,
                name=_with_token(strategy.name, axis, f"{seq}*"),
                output=strategy.output.with_placement(axis, GATHERED),
                collectives=collectives,
            )
            variants.append(_priced(node, variant, context))
    return variants


def gathered_input_variants(
    node: OpNode, positions: list[int], base: list[NodeStrategy], context: StrategyContext
) -> list[NodeStrategy]:
    """``g`` at the reader: for each activation input at ``positions`` (from producers that can gather) whose
    gradient a strategy all-reduces on an axis, that strategy reading it ``R*`` there instead."""
    variants = []
    for strategy in base:
        tokens = strategy.name.split(" ")
        for position in positions:
            for collective in strategy.collectives:
                kind, axis, phase, operand = collective
                if (kind, phase, operand) != ("all_reduce", "backward", position) or context.mesh.mesh_shape[axis] == 1:
                    continue
                spec = strategy.operands[position]
                assert spec is not None and spec.placements[axis] == REPLICATE
                gathered = spec.with_placement(axis, GATHERED)
                operands = (*strategy.operands[:position], gathered, *strategy.operands[position + 1 :])
                inputs = (*strategy.inputs[:position], gathered, *strategy.inputs[position + 1 :])
                variant = replace(
                    strategy,
                    name=_with_token(strategy.name, axis, f"{tokens[axis]}*"),
                    inputs=inputs,
                    operands=operands,
                    collectives=tuple(c for c in strategy.collectives if c != collective),
                )
                variants.append(_priced(node, variant, context))
    return variants


def computed_output(strategy: NodeStrategy, *, rank: int) -> ShardingSpec:
    """The spec ``strategy`` computes its output in, before its own output collectives: whole (a partial sum)
    where it reduce-scatters, sequence shards where it gathers (``rank``: the output's)."""
    spec = strategy.output
    for kind, axis, phase, operand in strategy.collectives:
        if phase == "forward" and operand is None and kind == "reduce_scatter":
            spec = spec.with_placement(axis, REPLICATE)
        elif phase == "forward" and operand is None and kind == "all_gather":
            spec = spec.with_placement(axis, shard(rank - 2))
    return spec


def is_sequence_parallel(strategy: NodeStrategy) -> bool:
    """One of sequence parallelism's variants: it scatters or gathers along the sequence, or makes or reads a
    gathered (``R*``) value."""
    specs = (strategy.output, *strategy.inputs, *strategy.operands)
    return uses_sequence_parallelism(strategy) or any(
        spec is not None and GATHERED in spec.placements for spec in specs
    )


def uses_sequence_parallelism(strategy: NodeStrategy) -> bool:
    """The strategy scatters its output along the sequence (``ḡ``) or gathers it from sequence shards (``g``)."""
    return any(
        phase == "forward" and operand is None and kind in ("reduce_scatter", "all_gather")
        for kind, _, phase, operand in strategy.collectives
    )
