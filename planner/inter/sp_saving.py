"""What Megatron sequence parallelism saves on each stage of a chosen plan (``Stage.sequence_parallel_saving``).

For a stage that uses it (:attr:`planner.plan.Stage.uses_sequence_parallelism`) the stage problem is built twice
on the stage's subgraph and mesh at the plan's microbatch size (:func:`planner.intra.stage_problem.build_stage_problem`):
with sequence parallelism's strategies, where the stored strategies are the choice ``x``, and without them
(``IntraOpOptions(sequence_parallel=False)``). The *next best* ``y`` keeps every node that uses no
sequence-parallel strategy (:func:`planner.sharding.sequence_parallel.is_sequence_parallel`) as it is and gives the
others the best non-sequence-parallel strategy: the problem without sequence parallelism, the kept nodes pinned,
solved exactly (:func:`planner.intra.ilp.solve_unconstrained`). Each is priced per step on its stage problem::

    seconds(c) = m · (objective(c) + recompute(c)) + m · zero_mb(c) + zero_step(c)
    bytes(c)   = state(c) + kept(c) · in_flight

``objective`` is the problem's per-microbatch objective (compute, collectives, resharding, and the gradient sync
and optimizer update amortised as ``step/m``, so ``m · objective`` counts them once per step); ``recompute`` the
forward of the stage's recomputed runs once more (:func:`planner.intra.stage_problem.recompute_s`), ``kept`` what a
microbatch keeps for backward (:func:`planner.intra.stage_problem.kept_bytes`; all activations without
recomputation), ``zero_*`` and ``state`` the stage's ZeRO level (:func:`planner.intra.stage_problem.zero_costs`).
``in_flight`` is the microbatches a stage holds: ``m`` under GPipe, ``min(S − s, m)`` for stage ``s`` of ``S``
otherwise (interleaved and zero-bubble plans: the same formula over their virtual stages, an approximation).
``saved_s = seconds(y) − seconds(x)``, ``saved_bytes = bytes(y) − bytes(x)``.

:func:`with_sequence_parallel_savings` runs once on the chosen plan (:func:`planner.api.plan_prepared`); stages of
the same shape, mesh and strategies are priced once.
"""

from __future__ import annotations

from dataclasses import replace

from planner.costing.records import record_of
from planner.costing.setup import CostSetup
from planner.inter.stage_shapes import shape_key
from planner.intra.ilp import solve_unconstrained
from planner.intra.problem import evaluate
from planner.intra.stage_problem import (
    IntraOpOptions,
    StageProblem,
    build_stage_problem,
    kept_bytes,
    recompute_s,
    zero_costs,
)
from planner.ir.graph import OpGraph, subgraph
from planner.ir.rebatch import MicrobatchGraphs
from planner.plan import Plan, Saving, Stage
from planner.sharding.sequence_parallel import is_sequence_parallel
from planner.sharding.specs import StageMesh

PINNED_S = 1e6  # the objective of a strategy a kept node may not take: never chosen
NEXT_BEST = "no sequence parallelism (its operators' best other strategies)"


def in_flight(schedule: str, *, num_stages: int, stage: int, m: int) -> int:
    """Microbatches stage ``stage`` of ``num_stages`` holds at once (see the module docstring)."""
    return m if schedule in ("gpipe", "dataflow") else max(1, min(num_stages - stage, m))


def with_sequence_parallel_savings(plan: Plan, graphs: MicrobatchGraphs, setup: CostSetup) -> Plan:
    """``plan`` with each sequence-parallel stage's saving stored (``graphs``: the model at each microbatch size)."""
    if not any(stage.uses_sequence_parallelism for stage in plan.stages):
        return plan
    graph = graphs.at(plan.batch_size // plan.num_microbatches)
    m, count, known = plan.num_microbatches, len(plan.stages), {}
    stages = []
    for stage in plan.stages:
        if stage.uses_sequence_parallelism:
            held = in_flight(plan.schedule, num_stages=count, stage=stage.index, m=m)
            stage = replace(
                stage, sequence_parallel_saving=stage_saving(stage, graph, setup, m=m, in_flight=held, known=known)
            )
        stages.append(stage)
    return replace(plan, stages=tuple(stages))


def stage_saving(
    stage: Stage, graph: OpGraph, setup: CostSetup, *, m: int, in_flight: int, known: dict | None = None
) -> Saving | None:
    """What a sequence-parallel stage saved (None if its strategies are not the rules'); ``known``: per-microbatch
    figures of stages already priced, by shape."""
    part = subgraph(graph, list(stage.nodes))
    start = stage.devices[0] % setup.cluster.devices_per_node
    key = (
        shape_key(part),
        stage.mesh_shape,
        start,
        tuple(d - stage.devices[0] for d in stage.devices),
        tuple(stage.strategies[name] for name in stage.nodes),
        tuple(map(len, stage.recomputed_runs())),
        stage.zero,
        m,
    )
    known = {} if known is None else known
    if key not in known:
        known[key] = _figures(stage, part, setup, m=m)
    figures = known[key]
    if figures is None:
        return None
    (chosen_s, chosen_state, chosen_kept), (other_s, other_state, other_kept) = figures
    chosen_bytes, other_bytes = chosen_state + chosen_kept * in_flight, other_state + other_kept * in_flight
    fits = other_bytes <= setup.memory_budget_bytes
    return Saving(
        choice="sequence parallel",
        next_best=NEXT_BEST + ("" if fits else " (does not fit)"),
        saved_s=other_s - chosen_s,
        saved_bytes=other_bytes - chosen_bytes,
    )


Figures = tuple[float, float, float]  # seconds per step, state bytes, kept bytes per microbatch


def _figures(stage: Stage, part: OpGraph, setup: CostSetup, *, m: int) -> tuple[Figures, Figures] | None:
    mesh = StageMesh(
        cluster=setup.cluster,
        devices=stage.devices,
        mesh_shape=stage.mesh_shape,
        activation_itemsize=setup.activation_itemsize,
    )
    with_sp = build_stage_problem(part, setup, mesh, IntraOpOptions(num_microbatches=m))
    chosen = stored_choice(with_sp, stage)
    if chosen is None:
        return None
    plain = build_stage_problem(part, setup, mesh, IntraOpOptions(num_microbatches=m, sequence_parallel=False))
    other = best_without_sequence_parallelism(plain, with_sp, chosen)
    runs = stage.recomputed_runs()
    return (
        _price(with_sp, chosen, runs=runs, zero=stage.zero, setup=setup),
        _price(plain, other, runs=runs, zero=stage.zero, setup=setup),
    )


def stored_choice(problem: StageProblem, stage: Stage) -> tuple[int, ...] | None:
    """The variable choice whose strategies are the stage's stored ones (None: one is not among the rules')."""
    choice = []
    for variable, name in enumerate(problem.variables):
        node, stored = problem.graph.node(name), stage.strategies[name]
        found = [i for i, strategy in enumerate(problem.strategies[variable]) if record_of(node, strategy) == stored]
        if not found:
            return None
        choice.append(found[0])
    return tuple(choice)


def best_without_sequence_parallelism(
    plain: StageProblem, with_sp: StageProblem, chosen: tuple[int, ...]
) -> tuple[int, ...]:
    """The choice of ``plain`` (no sequence-parallel strategies) that keeps every node of ``chosen`` not using
    sequence parallelism and is cheapest over the rest."""
    assert plain.variables == with_sp.variables, "one graph, one collapse: the same variables"
    costs = []
    for variable, row in enumerate(plain.problem.node_costs):
        strategy = with_sp.strategies[variable][chosen[variable]]
        options = plain.strategies[variable]
        keep = options.index(strategy) if strategy in options and not is_sequence_parallel(strategy) else None
        costs.append(tuple(c if keep in (None, i) else PINNED_S for i, c in enumerate(row)))
    return solve_unconstrained(replace(plain.problem, node_costs=tuple(costs))).choice


def _price(
    problem: StageProblem, choice: tuple[int, ...], *, runs: tuple[tuple[str, ...], ...], zero: int, setup: CostSetup
) -> Figures:
    """(seconds per step, state bytes, kept bytes per microbatch) of ``choice`` (see the module docstring)."""
    m = problem.num_microbatches
    objective, _ = evaluate(problem.problem, choice)
    seconds = m * (objective + (recompute_s(problem, choice, runs) if runs else 0.0))
    variables = [problem.variable_of[problem.representative[node.name]] for node in problem.graph.nodes]
    picked = [problem.costs[v][choice[v]] for v in variables]  # every node, copies of a layer included
    state = sum(c.state_bytes for c in picked)
    kept = kept_bytes(problem, choice, runs) if runs else sum(c.activation_bytes for c in picked)
    if zero:
        sharded = zero_costs(problem, choice, level=zero, setup=setup)
        seconds, state = seconds + m * sharded.per_microbatch_s + sharded.step_s, sharded.state_bytes
    return seconds, state, kept
