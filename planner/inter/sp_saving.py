"""What Megatron sequence parallelism saves on each stage of a chosen plan (``Stage.sequence_parallel_saving``).

For a stage that uses it (:attr:`planner.plan.Stage.uses_sequence_parallelism`) the search already holds the stage
problem it priced the stage on and the variable choice it picked there (:class:`planner.inter.stage_shapes.StageChoice`,
carried as ``PricedPipeline.stage_choices``): that problem has sequence parallelism's strategies and the choice is
``x``, the stage's stored strategies. The problem without them (``IntraOpOptions(sequence_parallel=False)``) is the
same problem with every sequence-parallel strategy dropped (:func:`without_sequence_parallelism`: each strategy's
costs and each resharding cost are priced on their own, so dropping rows and columns is building it again). The
*next best* ``y`` keeps every node that uses no sequence-parallel strategy
(:func:`planner.sharding.sequence_parallel.is_sequence_parallel`) as it is and gives the others the best
non-sequence-parallel strategy: the problem without sequence parallelism, the kept nodes pinned, solved exactly
(:func:`planner.intra.ilp.solve_unconstrained`). Each is priced per step on its stage problem::

    seconds(c) = m · (objective(c) + recompute(c)) + m · zero_mb(c) + zero_step(c)
    bytes(c)   = state(c) + kept(c) · in_flight

``objective`` is the problem's per-microbatch objective (compute, collectives, resharding, and the gradient sync
and optimizer update amortised as ``step/m``, so ``m · objective`` counts them once per step); ``recompute`` the
forward of the stage's recomputed runs once more (:func:`planner.intra.stage_problem.recompute_s`), ``kept`` what a
microbatch keeps for backward (:func:`planner.intra.stage_problem.kept_bytes`; all activations without
recomputation), ``zero_*`` and ``state`` the stage's ZeRO level (:func:`planner.intra.stage_problem.zero_costs`).
``in_flight`` is the microbatches a stage holds: ``m`` under GPipe, ``min(S − s, m)`` for stage ``s`` of ``S``
otherwise (interleaved and zero-bubble plans: the same formula over their virtual stages, an approximation;
:func:`planner.plan.schedules.in_flight_microbatches`).
``saved_s = seconds(y) − seconds(x)``, ``saved_bytes = bytes(y) − bytes(x)``.

:func:`with_sequence_parallel_savings` runs once on the chosen plan (:func:`planner.api.plan_prepared`); stages
that share a stage problem, choice, recomputation and ZeRO level are priced once (the template's memo).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from planner.costing.setup import CostSetup
from planner.inter.stage_shapes import StageChoice
from planner.intra.ilp import solve_unconstrained
from planner.intra.problem import evaluate
from planner.intra.stage_problem import StageProblem, kept_bytes, recompute_s, zero_costs
from planner.plan import Plan, Saving, Stage
from planner.plan.schedules import in_flight_microbatches
from planner.sharding.sequence_parallel import is_sequence_parallel

PINNED_S = 1e6  # the objective of a strategy a kept node may not take: never chosen
NEXT_BEST = "no sequence parallelism (its operators' best other strategies)"
Figures = tuple[float, float, float]  # seconds per step, state bytes, kept bytes per microbatch
Runs = tuple[tuple[str, ...], ...]


def with_sequence_parallel_savings(plan: Plan, picked: Sequence[StageChoice], setup: CostSetup) -> Plan:
    """``plan`` with each sequence-parallel stage's saving stored; ``picked``: what the search picked on each stage's
    problem (``PricedPipeline.stage_choices``; a stage without one says nothing)."""
    if not any(stage.uses_sequence_parallelism for stage in plan.stages):
        return plan
    choices = list(picked) if len(picked) == len(plan.stages) else [None] * len(plan.stages)
    m, count, stages = plan.num_microbatches, len(plan.stages), []
    for stage, choice in zip(plan.stages, choices, strict=True):
        if stage.uses_sequence_parallelism and choice is not None:
            held = in_flight_microbatches(plan.schedule, num_stages=count, stage=stage.index, m=m)
            stage = replace(stage, sequence_parallel_saving=stage_saving(stage, choice, setup, in_flight=held))
        stages.append(stage)
    return replace(plan, stages=tuple(stages))


def stage_saving(stage: Stage, picked: StageChoice, setup: CostSetup, *, in_flight: int) -> Saving:
    """``{choice, next_best, saved_s, saved_bytes}`` of a sequence-parallel stage, from what the search picked."""
    runs = tuple(tuple(picked.names[name] for name in run) for run in stage.recomputed_runs())
    memo, key = picked.template.memo, ("sequence parallel", picked.choice, runs, stage.zero)
    if key not in memo:
        memo[key] = _figures(picked.template.problem, picked.choice, runs=runs, zero=stage.zero, setup=setup)
    figures = memo[key]
    assert isinstance(figures, tuple)
    (chosen_s, chosen_state, chosen_kept), (other_s, other_state, other_kept) = figures
    chosen_bytes, other_bytes = chosen_state + chosen_kept * in_flight, other_state + other_kept * in_flight
    fits = other_bytes <= setup.memory_budget_bytes
    return Saving(
        choice="sequence parallel",
        next_best=NEXT_BEST + ("" if fits else " (does not fit)"),
        saved_s=other_s - chosen_s,
        saved_bytes=other_bytes - chosen_bytes,
    )


def _figures(
    with_sp: StageProblem, chosen: tuple[int, ...], *, runs: Runs, zero: int, setup: CostSetup
) -> tuple[Figures, Figures]:
    plain = without_sequence_parallelism(with_sp)
    other = best_without_sequence_parallelism(plain, with_sp, chosen)
    return (
        _price(with_sp, chosen, runs=runs, zero=zero, setup=setup),
        _price(plain, other, runs=runs, zero=zero, setup=setup),
    )


def without_sequence_parallelism(problem: StageProblem) -> StageProblem:
    """``problem`` without its sequence-parallel strategies (a node with no other keeps all of them), as
    :func:`planner.intra.stage_problem.build_stage_problem` builds it with ``sequence_parallel=False``."""
    kept = []
    for options in problem.strategies:
        plain = [i for i, strategy in enumerate(options) if not is_sequence_parallel(strategy)]
        kept.append(plain or list(range(len(options))))
    rows = problem.problem
    edges = tuple(
        replace(edge, cost=tuple(tuple(edge.cost[i][j] for j in kept[edge.target]) for i in kept[edge.source]))
        for edge in rows.edges
    )
    return replace(
        problem,
        strategies=_columns(problem.strategies, kept),
        costs=_columns(problem.costs, kept),
        problem=replace(
            rows, node_costs=_columns(rows.node_costs, kept), node_memory=_columns(rows.node_memory, kept), edges=edges
        ),
        sequence_parallel=False,
    )


def _columns(table: Sequence[Sequence[Any]], kept: list[list[int]]) -> tuple[tuple[Any, ...], ...]:
    """Each variable's row of ``table`` at its ``kept`` strategies."""
    return tuple(tuple(row[i] for i in keep) for row, keep in zip(table, kept, strict=True))


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


def _price(problem: StageProblem, choice: tuple[int, ...], *, runs: Runs, zero: int, setup: CostSetup) -> Figures:
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
