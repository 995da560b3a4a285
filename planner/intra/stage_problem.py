"""Intra-operator sharding of one stage on one logical mesh, by ILP (Alpa §4).

For every node v with strategies S_v (:func:`planner.sharding.op_rules.enumerate_strategies`) the ILP
(:func:`planner.intra.ilp.solve_strategy_ilp`) picks one, minimising seconds per microbatch::

    Σ_v  w_v · [ t_v(fwd+bwd) / shards_v(s)                 compute   — cost_models.compute
               + comm_v(s)                                   own collectives — NodeStrategy.comm_s
               + h · passes_v                                 sharded dispatch — sharded_dispatch_s
               + (grad_sync_v(s) + optimizer_v(s) + h · params_v) / m ]   once per step, over m microbatches
    + Σ_(u→v)  w_uv · reshard(out_u(s_u) → in_v(s_v))          edges — planner.sharding.specs.reshard_s

subject to  Σ_v w_v · mem_v(s) ≤ memory budget, where mem_v is the model state of v's
parameters at their shard counts (16 B/param for mixed-precision Adam; at ZeRO level ``zero``
the optimizer state, then the gradients, then the weights are also split over the axes the gradient
syncs over, and FSDP's collectives every microbatch join ``comm_v``) plus v's output if it is kept
for backward, at its local size. ``optimizer_v`` is the memory-bound Adam
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

import functools
import math
from collections import Counter
from dataclasses import dataclass

from cost_models.memory import kept_under_recompute, saved_values
from planner.costing.node_cost import NodeCost, grad_values, node_cost, strategy_context
from planner.costing.setup import CostSetup
from planner.errors import warn
from planner.intra.problem import StrategyEdge, StrategyProblem, evaluate
from planner.ir.graph import OpGraph, ValueKind
from planner.ir.layers import collapse_identical_layers
from planner.sharding.op_rules import enumerate_strategies
from planner.sharding.sequence_parallel import is_sequence_parallel
from planner.sharding.specs import StageMesh, reshard_s
from planner.sharding.strategies import NodeStrategy


@dataclass(frozen=True, kw_only=True)
class IntraOpOptions:
    num_microbatches: int = 1
    zero: int = 0  # ZeRO level over the data-parallel axes (planner.costing.zero)
    time_limit_s: float = 30.0
    gap: float = 0.0
    ddp: bool = False  # the stage runs as DDP on plain tensors (pure data parallelism): no DTensor dispatch
    sequence_parallel: bool = True  # False: no strategy scatters, gathers or consumes along the sequence (--space alpa)


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
    sequence_parallel: bool = True  # the strategies include Megatron sequence parallelism's (IntraOpOptions)

    @functools.cached_property
    def variable_of(self) -> dict[str, int]:
        """Representative node name -> its variable."""
        return {name: index for index, name in enumerate(self.variables)}

    def strategy_of(self, name: str, choice: tuple[int, ...]) -> NodeStrategy:
        """The strategy ``choice`` picks for node ``name`` (its representative's variable)."""
        variable = self.variable_of[self.representative[name]]
        return self.strategies[variable][choice[variable]]

    def cost_of(self, name: str, choice: tuple[int, ...]) -> NodeCost:
        """The cost of node ``name`` under the strategy ``choice`` picks (its representative's variable)."""
        variable = self.variable_of[self.representative[name]]
        return self.costs[variable][choice[variable]]


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
        if not options.sequence_parallel:
            options_v = [s for s in options_v if not is_sequence_parallel(s)] or options_v
        if reason:
            unruled.append(node.target)
        strategies.append(tuple(options_v))
        costs.append(
            tuple(
                node_cost(node, s, setup, mesh, saved=name in saved, zero=options.zero, ddp=options.ddp)
                for s in options_v
            )
        )
    weights = Counter(collapsed.representative.values())
    m = options.num_microbatches
    edges, self_costs = _edges(graph, collapsed.representative, index, strategies, mesh, context.grad_values)
    node_costs = [[c.compute_s + c.comm_s + c.zero_comm_s + c.step_s / m for c in row] for row in costs]
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
        warn(f"no sharding rule for {target}: it is replicated")
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
        sequence_parallel=options.sequence_parallel,
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


def recompute_s(
    problem: StageProblem, choice: tuple[int, ...], runs: tuple[tuple[str, ...], ...] | None = None
) -> float:
    """Seconds to recompute, once (a microbatch), the forward of ``runs`` (None: the whole stage) under a stage
    problem's ``choice``: each recomputed node's ``forward_s`` plus half the resharding into it. When the runs
    cover every node, the resharding is the objective less the nodes' own compute, collectives and amortised
    step. The simulator charges the same (:mod:`planner.costing.stage_work`: each recomputed node's ``fwd_s``
    again)."""
    inside = [name for run in runs for name in run] if runs is not None else []
    if runs is not None and len(set(inside)) < len(problem.graph.nodes):
        return _runs_forward_s(problem, choice, inside)
    objective, _ = evaluate(problem.problem, choice)
    forward = own = step = 0.0
    for node in problem.graph.nodes:
        c = problem.cost_of(node.name, choice)
        forward, own = forward + c.forward_s, own + c.compute_s + c.comm_s + c.zero_comm_s
        step += c.step_s
    reshard = max(0.0, objective - own - step / problem.num_microbatches)
    return forward + reshard / 2


def _runs_forward_s(problem: StageProblem, choice: tuple[int, ...], inside: list[str]) -> float:
    """Each node's ``forward_s`` plus half the resharding into it, priced once per representative and producers
    (copies of an identical layer cost the same)."""
    graph, grads = problem.graph, grad_values(problem.graph)
    seen: dict[tuple[str, ...], float] = {}
    total = 0.0
    for name in inside:
        node = graph.node(name)
        key = tuple(problem.representative.get(value, value) for value in (name, *node.inputs))
        if key not in seen:
            seen[key] = problem.cost_of(name, choice).forward_s + _reshard_into(problem, choice, name, grads) / 2
        total += seen[key]
    return total


def _reshard_into(problem: StageProblem, choice: tuple[int, ...], name: str, grads: frozenset[str]) -> float:
    """Seconds to bring ``name``'s inputs from their producers' specs to the ones its strategy reads."""
    graph, mesh, total = problem.graph, problem.mesh, 0.0
    node, strategy = graph.node(name), problem.strategy_of(name, choice)
    for position, (value, meta) in enumerate(zip(node.inputs, node.input_metas, strict=True)):
        need = strategy.inputs[position]
        if need is not None and graph.value_kind(value) == ValueKind.NODE:
            produced = problem.strategy_of(value, choice).output
            total += reshard_s(produced, need, meta, mesh, requires_grad=value in grads)
    return total


def kept_bytes(problem: StageProblem, choice: tuple[int, ...], runs: tuple[tuple[str, ...], ...]) -> float:
    """Activation bytes one microbatch keeps for backward when ``runs`` are recomputed
    (:func:`cost_models.memory.kept_under_recompute`): each kept value at its producer's local output size, or a
    graph input at the size its first reader reads it in, and the dropout masks and other kept extras (pooling
    indices, RNN gates) outside the runs."""
    graph, mesh = problem.graph, problem.mesh
    kept = kept_under_recompute(graph, runs)

    def cost(name: str) -> NodeCost:
        return problem.cost_of(name, choice)

    total = math.fsum(cost(name).mask_bytes for name in kept.masked)
    total += math.fsum(cost(n.name).extra_bytes for n in graph.nodes if n.name not in kept.recomputed)
    for value in kept.values:
        if graph.value_kind(value) == ValueKind.NODE:
            total += cost(value).output_bytes
        elif graph.value_kind(value) == ValueKind.INPUT:
            reader = next(n for n in graph.nodes if value in n.inputs)
            spec = problem.strategy_of(reader.name, choice).inputs[reader.inputs.index(value)]
            total += (
                mesh.local_bytes(graph.value(value).meta, spec)
                if spec is not None
                else mesh.tensor_bytes(graph.value(value).meta)
            )
    return total


@dataclass(frozen=True, kw_only=True)
class ZeroCosts:
    """A choice at a ZeRO level against the problem's own level (:func:`zero_costs`)."""

    per_microbatch_s: float  # FSDP's collectives every microbatch, added
    step_s: float  # once per step, added: the all-gather of updated parameters, the smaller optimizer update
    state_bytes: float  # the model state at the level


def zero_costs(problem: StageProblem, choice: tuple[int, ...], *, level: int, setup: CostSetup) -> ZeroCosts:
    """``choice`` at ZeRO ``level``: its parameter nodes priced again (:func:`planner.costing.node_cost.node_cost`)."""
    per_microbatch = step = state = 0.0
    for variable, name in enumerate(problem.variables):  # identical layers: one variable, counted per copy
        node, weight = problem.graph.node(name), problem.problem.node_weights[variable]
        base = problem.costs[variable][choice[variable]]
        if not node.params:
            state += weight * base.state_bytes
            continue
        other = node_cost(
            node, problem.strategies[variable][choice[variable]], setup, problem.mesh, saved=False, zero=level
        )
        per_microbatch += weight * (other.zero_comm_s - base.zero_comm_s)
        step += weight * (other.step_s - base.step_s)
        state += weight * other.state_bytes
    return ZeroCosts(per_microbatch_s=per_microbatch, step_s=step, state_bytes=state)
