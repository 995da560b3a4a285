"""Hand-written plans as strategy choices of a stage ILP: data parallel and Megatron.

Both are greedy walks in topological order: each node takes, among the strategies the plan
prefers for it, the one with the least node cost plus resharding from its already-chosen
producers (all strategies when none is preferred).

* :func:`data_parallel_choice` prefers outputs computed from the batch split on dim 0 on every
  mesh axis, and the others (a position-embedding slice, say) replicated.
* :func:`megatron_choice` (Megatron-LM tensor parallelism on the last mesh axis, data
  parallelism on the others): a linear whose input arrives split on its last dim over the
  tensor axis is row-parallel (``k`` split), any other linear column-parallel (``n`` split);
  attention splits heads, and so do the separate operators of an unfused attention (an operator keeps the
  split its inputs arrive in on the tensor axis); every other node prefers the batch on the data axes. With more
  than one device on the tensor axis it is sequence parallel, as Megatron-LM with ``--sequence-parallel``
  (:func:`_sequence_parallel`): row-parallel linears reduce-scatter along the sequence, the residual
  stream's adds, dropouts and norms run on sequence shards, and the norms read by column-parallel
  linears gather their outputs.
"""

from __future__ import annotations

from collections.abc import Callable

from planner.costing.estimate import batched_values
from planner.intra.problem import evaluate
from planner.intra.stage_problem import StageProblem
from planner.ir.graph import NodeKind, OpNode, ValueKind
from planner.sharding.specs import GATHERED, REPLICATE, shard
from planner.sharding.strategies import NodeStrategy

Preference = Callable[[OpNode, NodeStrategy, dict[str, NodeStrategy]], bool]


def greedy_choice(stage: StageProblem, *prefers: Preference) -> tuple[int, ...]:
    """Each node's cheapest strategy among those the first preference that admits any of them admits (all
    strategies when none does)."""
    graph = stage.graph
    index = {name: i for i, name in enumerate(stage.variables)}
    edges_into: dict[int, list] = {}
    for edge in stage.problem.edges:
        edges_into.setdefault(edge.target, []).append(edge)
    choice: dict[int, int] = {}
    chosen: dict[str, NodeStrategy] = {}
    for node in graph.nodes:
        variable = index[stage.representative[node.name]]
        if variable in choice:
            chosen[node.name] = stage.strategies[variable][choice[variable]]
            continue
        options = stage.strategies[variable]
        admitted = ([i for i, s in enumerate(options) if prefer(node, s, chosen)] for prefer in prefers)
        preferred = next((indices for indices in admitted if indices), list(range(len(options))))

        def cost(i: int, variable: int = variable) -> float:
            total = stage.problem.node_costs[variable][i]
            for edge in edges_into.get(variable, []):
                if edge.source in choice:
                    total += edge.cost[choice[edge.source]][i]
            return total

        choice[variable] = min(preferred, key=cost)
        chosen[node.name] = options[choice[variable]]
    return tuple(choice[v] for v in range(len(stage.variables)))


def _batch_everywhere(stage: StageProblem, axes: range) -> Preference:
    """Values computed from the batch split on dim 0 over ``axes``; the others stay replicated."""
    batched = batched_values(stage.graph)

    def prefers(node: OpNode, strategy: NodeStrategy, chosen: dict[str, NodeStrategy]) -> bool:
        wanted = shard(0) if node.name in batched else REPLICATE
        replicated = all(spec.placements[axis] == REPLICATE for _, spec in strategy.params for axis in axes)
        return replicated and all(strategy.output.placements[axis] == wanted for axis in axes)

    return prefers


def data_parallel_choice(stage: StageProblem) -> tuple[int, ...]:
    return greedy_choice(stage, _batch_everywhere(stage, range(stage.mesh.num_axes)))


def megatron_choice(stage: StageProblem, *, sequence_parallel: bool | None = None) -> tuple[int, ...]:
    """Megatron-LM's layout; with sequence parallelism (:func:`_sequence_parallel`) when the tensor axis has more
    than one device, as Megatron-LM runs with ``--sequence-parallel`` — unless no operator gathers for a
    column-parallel linear (no norm between the linears: nothing to split along the sequence, and a layer's
    sequence-split output would be gathered again by the next layer's linears), or the plain layout is faster
    and fits the memory budget, or fits where sequence parallelism does not. ``sequence_parallel`` True or False
    asks for that variant."""
    tensor_axis = stage.mesh.num_axes - 1
    data = _batch_everywhere(stage, range(tensor_axis))
    graph = stage.graph

    def arrives_split_last(node: OpNode, chosen: dict[str, NodeStrategy]) -> bool:
        source = node.inputs[0]
        if graph.value_kind(source) != ValueKind.NODE or source not in chosen:
            return False
        placement = chosen[source].output.placements[tensor_axis]
        return placement == shard(len(node.input_metas[0].shape) - 1)

    def prefers(node: OpNode, strategy: NodeStrategy, chosen: dict[str, NodeStrategy]) -> bool:
        if not data(node, strategy, chosen):
            return False
        rank = len(node.output.shape)
        placement = strategy.output.placements[tensor_axis]
        if node.kind == NodeKind.MATMUL and node.params:
            if arrives_split_last(node, chosen):
                first = strategy.inputs[0]
                return first is not None and first.placements[tensor_axis] == shard(len(node.input_metas[0].shape) - 1)
            return placement == shard(rank - 1)
        if node.kind == NodeKind.ATTENTION:
            return placement == shard(1)
        return (
            placement in (REPLICATE, shard(rank - 1))
            or node.kind == NodeKind.VIEW
            or keeps_split(node, strategy, chosen)
        )

    def keeps_split(node: OpNode, strategy: NodeStrategy, chosen: dict[str, NodeStrategy]) -> bool:
        """Reads every activation that arrives split on the tensor axis as it arrives and stays split: inside
        attention written as separate operators (``Q·Kᵀ``, scale, mask, softmax, dropout, ``·V``) the heads
        stay split, as Megatron-LM splits its attention by heads (Shoeybi et al. 2019, §3)."""
        arrived = [
            (position, chosen[name].output.placements[tensor_axis])
            for position, name in enumerate(node.inputs)
            if graph.value_kind(name) == ValueKind.NODE and name in chosen
        ]
        split = [(position, placement) for position, placement in arrived if placement.startswith("S(")]
        if not split or not strategy.output.placements[tensor_axis].startswith("S("):
            return False
        return all(
            strategy.inputs[position] is not None and strategy.inputs[position].placements[tensor_axis] == placement
            for position, placement in split
        )

    plain = greedy_choice(stage, prefers)
    if sequence_parallel is False or not stage.sequence_parallel or stage.mesh.mesh_shape[tensor_axis] == 1:
        return plain
    sequence = greedy_choice(stage, _sequence_parallel(stage, tensor_axis, data, arrives_split_last), prefers)
    return sequence if sequence_parallel else _plain_or_sequence_parallel(stage, plain, sequence)


def _plain_or_sequence_parallel(
    stage: StageProblem, plain: tuple[int, ...], sequence: tuple[int, ...]
) -> tuple[int, ...]:
    """``sequence`` unless nothing in it gathers for a column-parallel linear, or ``plain`` is faster and fits, or
    fits where ``sequence`` does not."""
    if not any(GATHERED in stage.strategies[v][i].output.placements for v, i in enumerate(sequence)):
        return plain  # no norm between the linears to split along the sequence: scattering only moves collectives
    (plain_s, plain_bytes), (sequence_s, sequence_bytes) = (evaluate(stage.problem, c) for c in (plain, sequence))
    budget = stage.problem.memory_budget
    plain_fits, sequence_fits = (budget is None or size <= budget for size in (plain_bytes, sequence_bytes))
    if plain_fits != sequence_fits:
        return plain if plain_fits else sequence
    return plain if plain_s < sequence_s else sequence


def _sequence_parallel(
    stage: StageProblem,
    axis: int,
    data: Preference,
    arrives_split_last: Callable[[OpNode, dict[str, NodeStrategy]], bool],
) -> Preference:
    """Megatron sequence parallelism (Korthikanti et al. 2022, §4.2.2) on the tensor ``axis`` (``data`` on the
    others): the row-parallel linears and the vocabulary-parallel embedding reduce-scatter their partial sums
    along the sequence (``ḡ``); the operators that read sequence shards keep them (the residual adds, dropouts
    and norms of the residual stream); an operator read by a column-parallel linear gathers its output (``g``,
    once for all its readers). Column-parallel linears and everything inside attention and the MLP admit
    nothing here: they keep Megatron's tensor-parallel preference (the next one :func:`greedy_choice` tries)."""
    graph = stage.graph
    readers = graph.consumers()

    def arrived(node: OpNode, chosen: dict[str, NodeStrategy]) -> list[tuple[int, str]]:
        """(position, placement on ``axis``) of each activation input as its producer left it."""
        return [
            (position, chosen[name].output.placements[axis])
            for position, name in enumerate(node.inputs)
            if graph.value_kind(name) == ValueKind.NODE and name in chosen
        ]

    def feeds_column_parallel(node: OpNode) -> bool:
        return any(
            graph.node(reader).kind == NodeKind.MATMUL
            and graph.node(reader).params
            and graph.node(reader).inputs[0] == node.name
            for reader in readers.get(node.name, ())
        )

    def prefers(node: OpNode, strategy: NodeStrategy, chosen: dict[str, NodeStrategy]) -> bool:
        if not data(node, strategy, chosen):
            return False
        sequence, placement = shard(len(node.output.shape) - 2), strategy.output.placements[axis]
        if node.kind == NodeKind.MATMUL and node.params:  # row-parallel, its partial sum reduce-scattered
            first = strategy.inputs[0]
            last = shard(len(node.input_metas[0].shape) - 1)
            split_last = first is not None and first.placements[axis] == last
            return arrives_split_last(node, chosen) and split_last and placement == sequence
        if node.kind == NodeKind.EMBEDDING and node.params:  # vocabulary-parallel, reduce-scattered
            vocabulary = any(spec.placements[axis] == shard(0) for _, spec in strategy.params)
            return vocabulary and placement == sequence
        if node.kind in (NodeKind.ATTENTION, NodeKind.MATMUL):
            return False
        inputs = arrived(node, chosen)
        sequence_of = {position: shard(len(node.input_metas[position].shape) - 2) for position, _ in inputs}
        split = [(position, text) for position, text in inputs if text.startswith("S(")]
        inside = [(position, text) for position, text in split if text != sequence_of[position]]
        if not inside and feeds_column_parallel(node):
            return placement == GATHERED
        kept = all(
            strategy.inputs[position] is not None and strategy.inputs[position].placements[axis] == text
            for position, text in inside or split
        )
        # inside attention or the MLP (heads or hidden split) the split stays; in the residual stream the sequence's
        return bool(split) and kept and placement not in (REPLICATE, GATHERED)

    return prefers
