"""Intra-operator sharding of one stage on one logical mesh, by ILP (Alpa §4).

For every node v with strategies S_v (:func:`planner.sharding.op_rules.enumerate_strategies`) the ILP
(:func:`planner.intra.ilp.solve_strategy_ilp`) picks one, minimising seconds per microbatch::

    Σ_v  w_v · [ t_v(fwd+bwd) / shards_v(s)                 compute   — cost_models.compute
               + comm_v(s)                                   own collectives — NodeStrategy.comm_s
               + h · passes_v                                 sharded dispatch — sharded_dispatch_s
               + (grad_sync_v(s) + optimizer_v(s) + h · params_v) / m ]   once per step, over m microbatches
    + Σ_(u→v)  w_uv · reshard(out_u(s_u) → in_v(s_v))          edges — planner.sharding.specs.reshard_s

subject to  Σ_v w_v · mem_v(s) ≤ memory budget, where mem_v is the model state of v's
parameters at their shard counts (16 B/param for mixed-precision Adam; with ``zero`` the
optimizer state and gradients are also split over the axes the gradient syncs over) plus v's
output if it is kept for backward, at its local size. ``optimizer_v`` is the memory-bound Adam
update of v's local parameters (:func:`planner.costing.estimate.optimizer_step_s`). ``h`` is the device's
calibrated ``sharded_op_overhead_s`` on a mesh of more than one device (the executor runs such
stages on DTensors), 0 on one device and on a stage run as DDP (``IntraOpOptions.ddp``: a one-stage
plan whose parameters are all replicated, priced by the simulator; DDP instead copies every gradient
into its bucket and back, ``DDP_BUCKET_COPIES`` passes over the gradient bytes in ``step_v``);
``passes_v`` is 2 when v has floating inputs, else 1. Every per-node term is
:func:`planner.costing.node_cost.node_cost`, the one the simulator charges the strategy a plan stores.

Identical layers (:func:`planner.ir.layers.collapse_identical_layers`) share one variable per
position: ``w_v`` counts the copies, so the ILP does not grow with the number of layers.
Graph inputs arrive in whatever spec a consumer wants (each device loads its own slice).
:func:`planner.intra.solve.solve_intra_op` seeds the solver with the data-parallel and Megatron
assignments (:mod:`planner.intra.incumbents`), so the answer is never worse than either.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass

from cost_models.memory import saved_values
from planner.costing.node_cost import NodeCost, node_cost, strategy_context
from planner.costing.setup import CostSetup
from planner.intra.problem import StrategyEdge, StrategyProblem, evaluate
from planner.ir.graph import OpGraph, ValueKind
from planner.ir.layers import collapse_identical_layers
from planner.sharding.op_rules import enumerate_strategies
from planner.sharding.specs import StageMesh, reshard_s
from planner.sharding.strategies import NodeStrategy


@dataclass(frozen=True, kw_only=True)
class IntraOpOptions:
    num_microbatches: int = 1
    zero: bool = False
    time_limit_s: float = 30.0
    gap: float = 0.0
    ddp: bool = False  # the stage runs as DDP on plain tensors (pure data parallelism): no DTensor dispatch


DEFAULT_OPTIONS = IntraOpOptions()


@dataclass(frozen=True, kw_only=True)
class StageProblem:
    """The ILP of one stage on one mesh, with what is needed to read its answer back."""

    graph: OpGraph
    mesh: StageMesh
    variables: tuple[str, ...]  # representative node per ILP variable
    strategies: tuple[tuple[NodeStrategy, ...], ...]
    costs: tuple[tuple[NodeCost, ...], ...]
    problem: StrategyProblem
    representative: dict[str, str]
    unruled: tuple[str, ...]  # targets replicated for lack of a rule
    num_microbatches: int = 1  # the m the objective amortises each step's work over


def build_stage_problem(
    graph: OpGraph, setup: CostSetup, mesh: StageMesh, options: IntraOpOptions = DEFAULT_OPTIONS
) -> StageProblem:
    collapsed = collapse_identical_layers(graph)
    context = strategy_context(graph, setup, mesh)
    saved = saved_values(graph)
    variables = collapsed.unique_nodes
    index = {name: i for i, name in enumerate(variables)}
    strategies, costs, unruled = [], [], []
    for name in variables:
        node = graph.node(name)
        options_v, reason = enumerate_strategies(node, context)
        if reason:
            unruled.append(node.target)
        strategies.append(tuple(options_v))
        costs.append(tuple(node_cost(node, s, setup, mesh, saved=name in saved, zero=options.zero, ddp=options.ddp)
                           for s in options_v))  # fmt: skip
    weights = Counter(collapsed.representative.values())
    m = options.num_microbatches
    edges, self_costs = _edges(graph, collapsed.representative, index, strategies, mesh, context.grad_values)
    node_costs = [[c.compute_s + c.comm_s + c.step_s / m for c in row] for row in costs]
    for variable, extra in self_costs.items():  # an edge between two copies of one layer position
        node_costs[variable] = [
            a + b / weights[variables[variable]] for a, b in zip(node_costs[variable], extra, strict=True)
        ]
    problem = StrategyProblem(
        names=tuple(variables),
        node_costs=tuple(tuple(row) for row in node_costs),
        node_memory=tuple(tuple(c.memory_bytes for c in row) for row in costs),
        node_weights=tuple(float(weights[name]) for name in variables),
        edges=tuple(edges),
        memory_budget=setup.memory_budget_bytes,
    )
    for target in sorted(set(unruled)):
        warnings.warn(f"no sharding rule for {target}: it is replicated", stacklevel=2)
    return StageProblem(
        graph=graph,
        mesh=mesh,
        variables=tuple(variables),
        strategies=tuple(strategies),
        costs=tuple(costs),
        problem=problem,
        representative=collapsed.representative,
        unruled=tuple(sorted(set(unruled))),
        num_microbatches=m,
    )


def _edges(
    graph: OpGraph,
    representative: dict[str, str],
    index: dict[str, int],
    strategies: list[tuple[NodeStrategy, ...]],
    mesh: StageMesh,
    needs_grad: frozenset[str],
) -> tuple[list[StrategyEdge], dict[int, list[float]]]:
    """One edge per graph edge, between representatives; identical copies merge in the ILP.

    An edge whose two ends share a representative costs its diagonal (both copies take the
    same strategy); those are returned per variable instead.
    """
    cache: dict[tuple[int, int, int], tuple[tuple[float, ...], ...]] = {}
    edges = []
    self_costs: dict[int, list[float]] = {}
    for node in graph.nodes:
        target = index[representative[node.name]]
        for position, (name, meta) in enumerate(zip(node.inputs, node.input_metas, strict=True)):
            if graph.value_kind(name) != ValueKind.NODE:
                continue
            source = index[representative[name]]
            key = (source, target, position)
            if key not in cache:
                cache[key] = tuple(
                    tuple(
                        reshard_s(out.output, need.inputs[position], meta, mesh, requires_grad=name in needs_grad)
                        if need.inputs[position] is not None
                        else 0.0
                        for need in strategies[target]
                    )
                    for out in strategies[source]
                )
            if source == target:
                diagonal = [cache[key][i][i] for i in range(len(cache[key]))]
                self_costs[source] = [
                    a + b for a, b in zip(self_costs.get(source, [0.0] * len(diagonal)), diagonal, strict=True)
                ]
            else:
                edges.append(StrategyEdge(source=source, target=target, cost=cache[key]))
    return edges, self_costs


def recompute_s(problem: StageProblem, choice: tuple[int, ...]) -> float:
    """Seconds to recompute the forward of a stage problem's ``choice`` once (a microbatch): each node's
    ``forward_s`` plus half the resharding between nodes, which is the objective less the nodes' own
    compute, collectives and amortised step. The simulator charges the same
    (:mod:`planner.costing.stage_work`: the chunk's ``fwd_s`` again)."""
    objective, _ = evaluate(problem.problem, choice)
    forward = own = step = 0.0
    index = {name: v for v, name in enumerate(problem.variables)}
    for node in problem.graph.nodes:
        variable = index[problem.representative[node.name]]
        cost = problem.costs[variable][choice[variable]]
        forward, own, step = forward + cost.forward_s, own + cost.compute_s + cost.comm_s, step + cost.step_s
    reshard = max(0.0, objective - own - step / problem.num_microbatches)
    return forward + reshard / 2
