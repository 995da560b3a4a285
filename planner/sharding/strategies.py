"""Sharding strategies of one operator on a logical mesh (Alpa §4's per-node choices).

Every strategy assigns each mesh axis at most one *split* and yields the node's output spec,
the spec each activation input must arrive in, the placement of each parameter, the factor
its compute is divided by, and the collectives it implies (in seconds on the stage's mesh):

* **Contractions** (:func:`contraction_strategies`: linear, mm, addmm, bmm, matmul, einsum,
  convolution, embedding, attention) are described by letters per tensor dim, einsum-style.
  Splitting letter ℓ over axis a (n devices):
  - ℓ in the output → output ``S(dim of ℓ)``; an activation input without ℓ is replicated on
    a and its gradient is all-reduced over a in backward (Megatron's column-parallel f);
    a parameter without ℓ is replicated on a and its gradient all-reduced once per step
    (``grad_sync_s``, data parallelism's gradient sync);
  - ℓ contracted (not in the output) → each device holds a partial sum: the output is
    all-reduced over a in forward (row-parallel linear, vocabulary-parallel embedding,
    input-channel-split convolution), or reduce-scattered along the sequence
    (:mod:`planner.sharding.sequence_parallel`).
  Batch split, column split, row split and their 2-D combinations on both axis orders are all
  instances. Expert-split MoE einsums need all-to-all, which appears as resharding
  ``S(d) → S(e)`` on their edges (:func:`planner.sharding.specs.reshard_s`).
* **Aligned** operators (:func:`aligned_strategies`: elementwise, norms, softmax, index and
  reduction operators with a ``dim``) split any output dim except those they work along;
  inputs follow by right-aligned broadcasting.
* **Views** (:mod:`planner.sharding.view_rules`) map a split of an input dim to a split of an output dim.
* Anything else is replicated (one strategy), and :func:`enumerate_strategies` reports it.

Only splits that divide the dim evenly are generated.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from planner.ir.graph import OpGraph, OpNode, TensorArg, ValueKind
from planner.sharding.specs import REPLICATE, ShardingSpec, StageMesh, shard


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeStrategy:
    name: str
    output: ShardingSpec
    inputs: tuple[ShardingSpec | None, ...]  # per node input; None: parameters, buffers, shape-only arguments
    params: tuple[tuple[str, ShardingSpec], ...] = ()
    compute_shards: int = 1
    comm_s: float = 0.0  # the node's own collectives, forward + backward, per microbatch
    grad_sync_s: float = 0.0  # all-reduce of parameter gradients, once per step
    grad_sync_axes: tuple[tuple[str, tuple[int, ...]], ...] = ()  # per parameter: axes its gradient syncs over
    # (kind, axis, phase, operand) of each own collective, per microbatch; operand: input position, None the output
    collectives: tuple[tuple[str, int, str, int | None], ...] = ()
    # per node input, the spec it is consumed in with parameters included (what a plan stores);
    # None: a buffer or an argument read only for its shape
    operands: tuple[ShardingSpec | None, ...] = ()


@dataclass(frozen=True, kw_only=True)
class StrategyContext:
    graph: OpGraph
    mesh: StageMesh
    grad_values: frozenset[str]  # values whose gradient is needed
    grad_itemsize: int  # bytes per gradient element (2 mixed precision, 4 fp32)

    @cached_property
    def readers(self) -> dict[str, list[str]]:
        """Value name -> the nodes that read it."""
        return self.graph.consumers()


@dataclass(frozen=True, kw_only=True)
class Letters:
    """Einsum-style description: letters per input (None: not a tensor to shard), output letters."""

    inputs: tuple[str | None, ...]
    output: str
    splittable: frozenset[str]


def axis_choices(candidates: Sequence[object], num_axes: int) -> list[tuple[object | None, ...]]:
    """Every assignment of at most one candidate to each mesh axis."""
    return list(itertools.product((None, *candidates), repeat=num_axes))


def _letter_sizes(node: OpNode, letters: Letters) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for meta, word in zip((*node.input_metas, node.output), (*letters.inputs, letters.output), strict=True):
        if word is None:
            continue
        for letter, size in zip(word, meta.shape, strict=True):
            if size != 1:
                sizes[letter] = size
    return sizes


def _spec_for(word: str | None, shape: Sequence[int], assignment: tuple[str | None, ...]) -> ShardingSpec:
    placements = []
    for letter in assignment:
        if word is not None and letter is not None and letter in word and shape[word.index(letter)] != 1:
            placements.append(shard(word.index(letter)))
        else:
            placements.append(REPLICATE)
    return ShardingSpec(tuple(placements))


def contraction_strategies(node: OpNode, letters: Letters, context: StrategyContext) -> list[NodeStrategy]:
    mesh = context.mesh
    sizes = _letter_sizes(node, letters)
    candidates = sorted(letter for letter in letters.splittable if letter in sizes)
    strategies = []
    for assignment in axis_choices(candidates, mesh.num_axes):
        per_letter: dict[str, int] = {}
        for axis, letter in enumerate(assignment):
            if letter is not None:
                per_letter[letter] = per_letter.get(letter, 1) * mesh.mesh_shape[axis]
        if any(sizes[letter] % shards for letter, shards in per_letter.items()):
            continue
        strategies.append(_contraction_strategy(node, letters, assignment, context))
    return strategies


def _contraction_strategy(
    node: OpNode, letters: Letters, assignment: tuple[str | None, ...], context: StrategyContext
) -> NodeStrategy:
    mesh, graph = context.mesh, context.graph
    output = _spec_for(letters.output, node.output.shape, assignment)
    input_specs = [
        _spec_for(word, meta.shape, assignment) for word, meta in zip(letters.inputs, node.input_metas, strict=True)
    ]
    comm_s = 0.0
    partial_axes = []
    for axis, letter in enumerate(assignment):
        if letter is not None and letter not in letters.output:
            comm_s += mesh.all_reduce_s(mesh.local_bytes(node.output, output), axis)  # partial sums
            partial_axes.append(("all_reduce", axis, "forward", None))
    strategy = _finish(
        node, assignment, output, input_specs, comm_s, context, graph, contracted=set(assignment) - set(letters.output)
    )
    return replace(strategy, collectives=(*partial_axes, *strategy.collectives))


def _finish(
    node: OpNode,
    assignment: tuple[object | None, ...],
    output: ShardingSpec,
    input_specs: list[ShardingSpec | None],
    comm_s: float,
    context: StrategyContext,
    graph: OpGraph,
    *,
    contracted: set[object],
) -> NodeStrategy:
    """Add backward all-reduces of replicated inputs and the gradient sync of parameters.

    An input spec of None marks an argument read only for its shape or dtype (``view_as``'s
    ``other``): it needs no layout and gets no gradient.
    """
    mesh = context.mesh
    split_axes = [axis for axis, choice in enumerate(assignment) if choice is not None and choice not in contracted]
    inputs: list[ShardingSpec | None] = []
    operands: list[ShardingSpec | None] = []
    params: dict[str, ShardingSpec] = {}
    sync_axes: dict[str, tuple[int, ...]] = {}
    grad_sync_s = 0.0
    backward: list[tuple[str, int, str, int | None]] = []  # all-reduces of replicated inputs' gradients
    for position, (name, meta, spec) in enumerate(zip(node.inputs, node.input_metas, input_specs, strict=True)):
        kind = graph.value_kind(name)
        operands.append(None if kind == ValueKind.BUFFER else spec)
        if spec is None:  # shape-only: a parameter read so is kept whole and gets no gradient sync
            inputs.append(None)
            if kind == ValueKind.PARAM and name not in params:
                params[name], sync_axes[name] = ShardingSpec.replicated(mesh.num_axes), ()
            continue
        replicated_on = [axis for axis in split_axes if spec.placements[axis] == REPLICATE]
        if kind in (ValueKind.PARAM, ValueKind.BUFFER):
            inputs.append(None)
            if kind == ValueKind.PARAM and name not in params:
                params[name] = spec
                sync_axes[name] = tuple(replicated_on)
                grad_bytes = meta.numel * context.grad_itemsize / spec.num_shards(mesh.mesh_shape)
                grad_sync_s += sum(mesh.grad_sync_s(grad_bytes, axis) for axis in replicated_on)
            continue
        inputs.append(spec)
        if name in context.grad_values:
            comm_s += sum(mesh.all_reduce_s(mesh.local_bytes(meta, spec), axis) for axis in replicated_on)
            backward.extend(("all_reduce", axis, "backward", position) for axis in replicated_on)
    shards = math.prod(mesh.mesh_shape[axis] for axis, choice in enumerate(assignment) if choice is not None)
    return NodeStrategy(
        name=" ".join(str(choice) if choice is not None else "-" for choice in assignment),
        output=output,
        inputs=tuple(inputs),
        params=tuple(params.items()),
        compute_shards=shards,
        comm_s=comm_s,
        grad_sync_s=grad_sync_s,
        grad_sync_axes=tuple(sync_axes.items()),
        collectives=tuple(backward),
        operands=tuple(operands),
    )


def aligned_strategies(node: OpNode, excluded_dims: set[int], context: StrategyContext) -> list[NodeStrategy]:
    """Split output dims (except ``excluded_dims``); inputs follow by right-aligned broadcasting."""
    mesh = context.mesh
    shape = node.output.shape
    rank = len(shape)
    candidates = [dim for dim in range(rank) if dim not in {d % rank for d in excluded_dims} and shape[dim] > 1]
    strategies = []
    for assignment in axis_choices(candidates, mesh.num_axes):
        output = ShardingSpec(tuple(REPLICATE if dim is None else shard(dim) for dim in assignment))
        if not output.fits(shape, mesh.mesh_shape):
            continue
        input_specs = [_broadcast_spec(output, rank, meta.shape) for meta in node.input_metas]
        strategies.append(_finish(node, assignment, output, input_specs, 0.0, context, context.graph, contracted=set()))
    return strategies


def _broadcast_spec(output: ShardingSpec, out_rank: int, shape: Sequence[int]) -> ShardingSpec:
    offset = out_rank - len(shape)
    placements = []
    for placement in output.placements:
        dim = None if placement == REPLICATE else int(placement[2:-1])
        if dim is None or dim - offset < 0 or shape[dim - offset] == 1:
            placements.append(REPLICATE)
        else:
            placements.append(shard(dim - offset))
    return ShardingSpec(tuple(placements))


def replicated_strategy(node: OpNode, context: StrategyContext) -> NodeStrategy:
    num_axes = context.mesh.num_axes
    spec = ShardingSpec.replicated(num_axes)
    assignment = (None,) * num_axes
    return _finish(node, assignment, spec, [spec] * len(node.inputs), 0.0, context, context.graph, contracted=set())


Collective = tuple[str, int, str, int | None]  # (kind, mesh axis, phase, operand: input position or None, the output)


def own_collectives_s(
    node: OpNode,
    collectives: Sequence[Collective],
    *,
    output: ShardingSpec,
    operands: Sequence[ShardingSpec | None],
    mesh: StageMesh,
) -> float:
    """Seconds of a node's own forward and backward collectives, each on its tensor local to the other mesh axes
    and whole on its own (:meth:`StageMesh.gathered_bytes`), summed in one order — the forward ones, then each
    input's backward ones, then the output gradient's — so a strategy and its stored record price alike
    (:func:`planner.costing.records.strategy_of`)."""
    total = 0.0
    for kind, axis, phase, operand in collectives:
        if phase == "forward":
            meta, spec = (node.output, output) if operand is None else (node.input_metas[operand], operands[operand])
            assert spec is not None, f"{node.name}: a collective on an operand without a layout"
            total += mesh.collective_s(kind, mesh.gathered_bytes(meta, spec, axis), axis)
    for position, (meta, spec) in enumerate(zip(node.input_metas, operands, strict=True)):
        moved = [
            (kind, axis) for kind, axis, phase, operand in collectives if phase == "backward" and operand == position
        ]
        if spec is not None and moved:
            total += sum(mesh.collective_s(kind, mesh.gathered_bytes(meta, spec, axis), axis) for kind, axis in moved)
    for kind, axis, phase, operand in collectives:
        if phase == "backward" and operand is None:
            total += mesh.collective_s(kind, mesh.gathered_bytes(node.output, output, axis), axis)
    return total


def tensor_positions(node: OpNode) -> dict[int, int]:
    """Positional argument index -> index into ``node.inputs`` for tensor arguments."""
    return {position: arg.index for position, arg in enumerate(node.args) if isinstance(arg, TensorArg)}
