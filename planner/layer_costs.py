"""Cost options of one layer on one logical mesh, for composing pipeline stages (Alpa §5).

A layer (:func:`planner.layers.graph_layers`) is cut out of the graph as its own
:class:`~planner.graph.OpGraph` (:func:`subgraph`): values from other layers become graph
inputs, so the stage ILP (:func:`planner.intra_op.solve_intra_op`) prices its operators alone.
:func:`layer_options` solves that ILP under a ladder of memory budgets (no limit, then halving)
and returns the distinct (time, memory) points, each with and without activation
recomputation:

* no recomputation: time = ILP objective; activations kept = the saved outputs' bytes;
* recomputation: time + the forward compute once more (a third of forward+backward compute
  for matmul-dominated layers); activations kept = the layer's inputs at their local size.

Identical layers share one set of options (keyed by their structural hash), so a GPT of 48
blocks costs one ILP ladder per mesh for its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.estimate import CostSetup
from planner.graph import GraphValue, OpGraph, ValueKind
from planner.ilp import MemoryBudgetError
from planner.intra_op import IntraOpOptions, IntraOpResult, solve_intra_op
from planner.sharding import StageMesh

MEMORY_LADDER = (None, 0.5, 0.25, 0.125)


def subgraph(graph: OpGraph, names: list[str]) -> OpGraph:
    """The nodes ``names`` as a graph of their own; values from outside become its inputs."""
    inside = set(names)
    nodes = [graph.node(name) for name in names]
    inputs: dict[str, GraphValue] = {}
    params: dict[str, GraphValue] = {}
    buffers: dict[str, GraphValue] = {}
    for node in nodes:
        for name, meta in zip(node.inputs, node.input_metas, strict=True):
            if name in inside:
                continue
            kind = graph.value_kind(name)
            if kind == ValueKind.PARAM:
                params[name] = graph.value(name)
            elif kind == ValueKind.BUFFER:
                buffers[name] = graph.value(name)
            else:
                inputs.setdefault(name, GraphValue(name=name, kind=ValueKind.INPUT, meta=meta))
    readers_outside = {name for node in graph.nodes if node.name not in inside for name in node.inputs}
    outputs = tuple(n for n in names if n in readers_outside or n in graph.outputs)
    return OpGraph(
        nodes=tuple(nodes),
        inputs=tuple(inputs.values()),
        params=tuple(params.values()),
        buffers=tuple(buffers.values()),
        outputs=outputs,
    )


@dataclass(frozen=True, kw_only=True)
class LayerOption:
    time_s: float  # forward + backward of one microbatch, gradient sync amortised
    state_bytes: float
    activation_bytes: float  # kept per in-flight microbatch
    remat: bool
    result: IntraOpResult


def _input_bytes(result: IntraOpResult) -> float:
    graph, mesh = result.stage.graph, result.stage.mesh
    total = 0.0
    for value in graph.inputs:
        readers = [n for n in graph.nodes if value.name in n.inputs]
        spec = next((result.strategy_of(n.name).inputs[n.inputs.index(value.name)] for n in readers), None)
        total += mesh.local_bytes(value.meta, spec) if spec is not None else mesh.tensor_bytes(value.meta)
    return total


def _split_memory(result: IntraOpResult) -> tuple[float, float, float]:
    """(state bytes, activation bytes, compute seconds) of a solved layer."""
    stage = result.stage
    state = activation = compute = 0.0
    for name in stage.graph.nodes:
        variable = stage.variables.index(stage.representative[name.name])
        cost = stage.costs[variable][result.choice[variable]]
        state, activation, compute = (
            state + cost.state_bytes,
            activation + cost.activation_bytes,
            compute + cost.compute_s,
        )
    return state, activation, compute


def layer_options(
    layer: OpGraph, setup: CostSetup, mesh: StageMesh, *, options: IntraOpOptions, ladder: tuple = MEMORY_LADDER
) -> list[LayerOption]:
    """Pareto-useful (time, memory) options of ``layer`` on ``mesh``; empty if none fits the device."""
    found: list[LayerOption] = []
    reference: float | None = None
    for share in ladder:
        budget = setup.memory_budget_bytes if share is None or reference is None else reference * share
        try:
            result = solve_intra_op(
                layer, replace(setup, memory_fraction=budget / setup.cluster.device.memory_bytes), mesh, options
            )
        except MemoryBudgetError:
            break
        reference = result.memory_bytes if reference is None else reference
        state, activation, compute = _split_memory(result)
        if found and found[-1].state_bytes + found[-1].activation_bytes <= state + activation:
            continue
        found.append(
            LayerOption(
                time_s=result.objective_s, state_bytes=state, activation_bytes=activation, remat=False, result=result
            )
        )
        found.append(
            LayerOption(
                time_s=result.objective_s + compute / 3,
                state_bytes=state,
                activation_bytes=_input_bytes(result),
                remat=True,
                result=result,
            )
        )
    return found
