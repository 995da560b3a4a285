"""Hand-written plans as strategy choices of a stage ILP: data parallel and Megatron.

Both are greedy walks in topological order: each node takes, among the strategies the plan
prefers for it, the one with the least node cost plus resharding from its already-chosen
producers (all strategies when none is preferred).

* :func:`data_parallel_choice` prefers outputs computed from the batch split on dim 0 on every
  mesh axis, and the others (a position-embedding slice, say) replicated.
* :func:`megatron_choice` (Megatron-LM tensor parallelism on the last mesh axis, data
  parallelism on the others): a linear whose input arrives split on its last dim over the
  tensor axis is row-parallel (``k`` split), any other linear column-parallel (``n`` split);
  attention splits heads; every other node prefers the batch on the data axes.
"""

from __future__ import annotations

from collections.abc import Callable

from planner.costing.estimate import batched_values
from planner.intra.stage_problem import StageProblem
from planner.ir.graph import NodeKind, OpNode, ValueKind
from planner.sharding.specs import REPLICATE, shard
from planner.sharding.strategies import NodeStrategy

Preference = Callable[[OpNode, NodeStrategy, dict[str, NodeStrategy]], bool]


def greedy_choice(stage: StageProblem, prefers: Preference) -> tuple[int, ...]:
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
        preferred = [i for i, s in enumerate(options) if prefers(node, s, chosen)] or list(range(len(options)))

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
        return all(strategy.output.placements[axis] == wanted for axis in axes)

    return prefers


def data_parallel_choice(stage: StageProblem) -> tuple[int, ...]:
    return greedy_choice(stage, _batch_everywhere(stage, range(stage.mesh.num_axes)))


def megatron_choice(stage: StageProblem) -> tuple[int, ...]:
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
        return placement in (REPLICATE, shard(rank - 1)) or node.kind == NodeKind.VIEW

    return greedy_choice(stage, prefers)
