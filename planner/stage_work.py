"""What one microbatch costs on each node of a plan, read back from the plan itself.

The simulator judges a plan by what it *says* (node output specs, parameter placements,
recomputation), not by how the planner found it. For each stage :func:`stage_node_work` rebuilds
the stage's intra-op problem on its devices and mesh (:func:`planner.intra_op.build_stage_problem`)
and, in topological order, picks for every node the strategy whose output spec and parameter
specs are the plan's, the cheapest of those given the strategies already picked for its producers
(``compute + comm + step/m + reshard of its inputs``). A node's work is then

* ``fwd_s`` = compute × fwd/(fwd+bwd) of the compute model + half its own collectives + half the
  resharding of its inputs; ``bwd_s`` = the rest (collectives and resharding have a forward and a
  backward half: the all-reduce of a row-split matmul forward, of a column-split one's input
  gradient backward);
* ``step_s`` = gradient sync + optimizer update, once per step; ``state_bytes`` and
  ``activation_bytes`` as the intra-op problem charges them.

A plan whose spec no strategy produces raises :class:`~planner.plan.PlanError` naming the node.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from planner.estimate import CostSetup
from planner.graph import OpGraph, ValueKind
from planner.intra_op import IntraOpOptions, StageProblem, build_stage_problem
from planner.layer_costs import subgraph
from planner.plan import PlanError, Stage
from planner.sharding import StageMesh, reshard_s
from planner.strategies import NodeStrategy


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeWork:
    fwd_s: float
    bwd_s: float
    step_s: float
    state_bytes: float
    activation_bytes: float
    input_bytes: float = 0.0  # stage inputs this node reads (what recomputation keeps)
    compute_s: float = 0.0  # the parts of fwd_s + bwd_s, for explanations
    comm_s: float = 0.0
    reshard_s: float = 0.0


def runs_as_ddp(stages: list[Stage] | tuple[Stage, ...], *, zero: bool) -> bool:
    """Pure data parallelism, which the executor runs with DDP on plain tensors: one stage on several
    devices, every parameter replicated, optimizer state not sharded (``zero`` runs FSDP)."""
    return (
        len(stages) == 1 and len(stages[0].devices) > 1 and not zero
        and all(set(spec) == {"R"} for spec in stages[0].param_placements.values())
    )  # fmt: skip


def stage_node_work(
    stage: Stage, graph: OpGraph, setup: CostSetup, *, num_microbatches: int, zero: bool = False, ddp: bool = False
) -> dict[str, NodeWork]:
    """Node name -> its work per microbatch on ``stage`` (``graph`` at the microbatch size); ``ddp``: see
    :func:`runs_as_ddp`."""
    mesh = StageMesh(cluster=setup.cluster, devices=stage.devices, mesh_shape=stage.mesh_shape,
                     activation_itemsize=setup.activation_itemsize)  # fmt: skip
    local = subgraph(graph, list(stage.nodes))
    options = IntraOpOptions(num_microbatches=num_microbatches, zero=zero, ddp=ddp)
    problem = build_stage_problem(local, setup, mesh, options)
    chosen: dict[str, NodeStrategy] = {}
    work: dict[str, NodeWork] = {}
    grad = {p.name for p in local.params}
    first_reader: dict[str, str] = {}
    for node in local.nodes:
        for value in node.inputs:
            first_reader.setdefault(value, node.name)
    for node in local.nodes:
        strategy, cost = _choose(problem, stage, node.name, chosen, grad, num_microbatches)
        chosen[node.name] = strategy
        reshard = _reshard_in(problem, node.name, strategy, chosen, grad)
        if node.output.is_floating and any(name in grad for name in node.inputs):
            grad.add(node.name)
        time = setup.compute.node_time(node)
        forward = time.fwd_s / time.total_s if time.total_s > 0 else 1.0
        fixed = (cost.comm_s + reshard) / 2
        work[node.name] = NodeWork(
            fwd_s=cost.compute_s * forward + fixed,
            bwd_s=cost.compute_s * (1 - forward) + fixed,
            step_s=cost.step_s,
            state_bytes=cost.state_bytes,
            activation_bytes=cost.activation_bytes,
            input_bytes=_input_bytes(problem, node.name, strategy, first_reader),
            compute_s=cost.compute_s,
            comm_s=cost.comm_s,
            reshard_s=reshard,
        )
    return work


def stage_strategies(
    stage: Stage, graph: OpGraph, setup: CostSetup, *, num_microbatches: int, zero: bool = False
) -> dict[str, NodeStrategy]:
    """Node name -> the strategy the plan's specs select on ``stage`` (what an executor must run)."""
    mesh = StageMesh(cluster=setup.cluster, devices=stage.devices, mesh_shape=stage.mesh_shape,
                     activation_itemsize=setup.activation_itemsize)  # fmt: skip
    local = subgraph(graph, list(stage.nodes))
    problem = build_stage_problem(local, setup, mesh, IntraOpOptions(num_microbatches=num_microbatches, zero=zero))
    chosen: dict[str, NodeStrategy] = {}
    grad = {p.name for p in local.params}
    for node in local.nodes:
        chosen[node.name] = _choose(problem, stage, node.name, chosen, grad, num_microbatches)[0]
        if node.output.is_floating and any(name in grad for name in node.inputs):
            grad.add(node.name)
    return chosen


def _choose(
    problem: StageProblem, stage: Stage, name: str, chosen: Mapping[str, NodeStrategy], grad: set[str], m: int
) -> tuple[NodeStrategy, Any]:
    variable = problem.variables.index(problem.representative[name])
    best = _pick(problem, stage, name, variable, chosen, grad, m)
    return _own_strategy(problem, name, problem.strategies[variable][best]), problem.costs[variable][best]


def _own_strategy(problem: StageProblem, name: str, strategy: NodeStrategy) -> NodeStrategy:
    """A representative's strategy with the parameter names of ``name`` (identical layers share one)."""
    rep = problem.representative[name]
    if rep == name:
        return strategy
    own = dict(zip(problem.graph.node(rep).inputs, problem.graph.node(name).inputs, strict=True))
    return replace(
        strategy,
        params=tuple((own.get(p, p), spec) for p, spec in strategy.params),
        grad_sync_axes=tuple((own.get(p, p), axes) for p, axes in strategy.grad_sync_axes),
    )


def _pick(
    problem: StageProblem, stage: Stage, name: str, variable: int, chosen: Mapping[str, NodeStrategy],
    grad: set[str], m: int,
) -> int:  # fmt: skip
    graph = problem.graph
    node, rep = graph.node(name), graph.node(problem.representative[name])
    own_param = dict(zip(rep.inputs, node.inputs, strict=True))
    wanted = stage.node_shardings.get(name)
    best, best_s = None, float("inf")
    for index, strategy in enumerate(problem.strategies[variable]):
        if wanted is not None and strategy.output.placements != tuple(wanted):
            continue
        placements = (stage.param_placements.get(own_param[p]) for p, _ in strategy.params)
        if any(want is not None and tuple(want) != spec.placements
               for want, (_, spec) in zip(placements, strategy.params, strict=True)):  # fmt: skip
            continue
        cost = problem.costs[variable][index]
        seconds = cost.compute_s + cost.comm_s + cost.step_s / m + _reshard_in(problem, name, strategy, chosen, grad)
        if seconds < best_s:
            best, best_s = index, seconds
    if best is None:
        raise PlanError(
            f"stage {stage.index}: node {name} has spec {list(wanted or ())} with parameters "
            f"{[list(stage.param_placements.get(p, ())) for p in node.params]}, which no sharding strategy of "
            f"{node.target} on mesh {list(stage.mesh_shape)} produces"
        )
    return best


def _reshard_in(
    problem: StageProblem, name: str, strategy: NodeStrategy, chosen: Mapping[str, NodeStrategy], grad: set[str]
) -> float:
    """Seconds to bring the node's inputs from their producers' specs to the ones it needs."""
    graph, total = problem.graph, 0.0
    node = graph.node(name)
    for position, (value, meta) in enumerate(zip(node.inputs, node.input_metas, strict=True)):
        need = strategy.inputs[position]
        if need is None or graph.value_kind(value) != ValueKind.NODE:
            continue
        total += reshard_s(chosen[value].output, need, meta, problem.mesh, requires_grad=value in grad)
    return total


def _input_bytes(problem: StageProblem, name: str, strategy: NodeStrategy, first_reader: Mapping[str, str]) -> float:
    """Stage inputs (values from other stages or the data) this node reads, at its local size;
    a value read by several nodes is counted by its first reader only."""
    graph, mesh, total = problem.graph, problem.mesh, 0.0
    node = graph.node(name)
    for position, value in enumerate(node.inputs):
        if graph.value_kind(value) != ValueKind.INPUT:
            continue
        if first_reader[value] != name or node.inputs.index(value) != position:
            continue
        meta, need = graph.value(value).meta, strategy.inputs[position]
        total += mesh.local_bytes(meta, need) if need is not None else mesh.tensor_bytes(meta)
    return total
