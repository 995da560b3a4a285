"""Choose one strategy per variable: the integer linear program of Alpa §4, solver-agnostic.

A :class:`StrategyProblem` has variables ``v`` (operators, say), each with ``k_v`` strategies,
and edges ``(u, v)`` with a cost for every pair of strategies. Write ``c_v = w_v·node_costs[v]``
and ``m_v = w_v·node_memory[v]`` (``w_v`` the variable's multiplicity), ``C_uv`` the sum of
``w_e·cost_e`` over the edges from ``u`` to ``v`` plus ``w_e·cost_eᵀ`` over those from ``v``
to ``u`` (:func:`planner.intra.ilp_matrix.merge_edges`), ``B`` the memory budget. With binary ``s_v ∈ {0,1}^{k_v}``
and continuous ``e_uv ∈ ℝ_{≥0}^{k_u×k_v}``, :func:`build_matrix` builds::

    minimise  Σ_v c_v·s_v + Σ_(u,v) Σ_ij C_uv[i,j]·e_uv[i,j]               (ilp_matrix._objective)
    s.t.      Σ_i s_v[i] = 1                             for every v        (ilp_matrix._one_hot_rows)
              Σ_j e_uv[i,j] = s_u[i]                     for every (u,v), i (ilp_matrix._edge_rows)
              Σ_i e_uv[i,j] = s_v[j]                     for every (u,v), j (ilp_matrix._edge_rows)
              Σ_v (m_v − min m_v)·s_v ≤ B − M_min                           (ilp_matrix._memory_row)

    M_min = Σ_v min_i m_v[i]                                                 (smallest_memory)

``e_uv`` needs no integrality: once ``s`` is binary, the rows of ``e_uv`` other than ``s_u``'s
chosen one sum to zero, so that one row equals ``s_v``: ``e_uv = s_u s_vᵀ``. Declaring it
binary would only widen the branching.

Reductions (:func:`planner.intra.ilp_matrix.reduce_problem`), all exact: a variable with one strategy is a
constant; an edge with one constant end adds a row or column of ``C_uv`` to the other end's ``c``; an edge whose
merged matrix is separable, ``C_uv[i,j] = a_i + b_j`` (all-zero ones included), adds ``a`` to
``c_u`` and ``b`` to ``c_v``, since the edge rows give ``Σ_ij (a_i + b_j)·e_uv[i,j] = a·s_u +
b·s_v``. Dominated strategies are kept: one cheaper and smaller than another can still lose
through its edges. Costs are scaled to at most 1, memory to the largest ``m_v − min m_v``.

The memory-minimising ILP (same rows, no budget) is separable because the edge rows hold for
any ``s``: its optimum is ``M_min``, and ``M_min > B`` means nothing fits (:func:`_memory_slack`).
The MIP start is the cheapest fitting one of the incumbents and the smallest assignment,
improved by local search (:func:`_mip_start`); the solver's answer replaces it only if no dearer,
so a time-limited solve never returns worse. Reported objectives and memory are :func:`evaluate`'s.

The sparse matrix goes to HiGHS in bulk through highspy (:func:`_solve_highs`): building PuLP
objects costs seconds per 100k columns, and ``pulp.HiGHS`` passes no MIP start. ``solver="cbc"``
rebuilds the same matrix in PuLP (:func:`_solve_pulp`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from cost_models.units import GIB
from planner.intra.ilp_matrix import (
    Reduced,
    build_matrix,
    merge_edges,
    read_choice,
    reduce_problem,
    run_solver,
    start_vector,
)
from planner.intra.problem import MemoryBudgetError, StrategyProblem, StrategySolution, evaluate, smallest_memory

_SOLVERS = ("highs", "cbc")  # HiGHS through highspy, CBC through PuLP
_SEPARABLE_TOLERANCE = 1e-12
_FEASIBILITY_TOLERANCE = 1e-6  # HiGHS's and CBC's default for rows
_BRUTE_FORCE_LIMIT = 2_000_000
_LOCAL_SWEEPS = 100


def brute_force(problem: StrategyProblem) -> StrategySolution | None:
    """The optimum by enumerating every assignment (small problems, for tests); None if none fits."""
    started, sizes = time.perf_counter(), [len(costs) for costs in problem.node_costs]
    if math.prod(sizes) > _BRUTE_FORCE_LIMIT:
        raise ValueError(f"{math.prod(sizes)} assignments are too many to enumerate")
    objective, memory = np.zeros(sizes), np.zeros(sizes)  # indexed by the choice
    for v, weight in enumerate(problem.node_weights):
        objective = objective + weight * np.asarray(problem.node_costs[v]).reshape(_axes(sizes, v))
        memory = memory + weight * np.asarray(problem.node_memory[v]).reshape(_axes(sizes, v))
    for (u, v), matrix in merge_edges(problem).items():
        objective = objective + matrix.reshape(_axes(sizes, u, v))
    if problem.memory_budget is not None:
        objective = np.where(memory <= problem.memory_budget, objective, np.inf)
    if not np.isfinite(objective).any():
        return None
    choice = tuple(int(i) for i in np.unravel_index(int(np.argmin(objective)), sizes))
    details = {"num_variables": 0, "num_constraints": 0, "build_s": 0.0, "status": "enumerated"}
    return _solution(problem, choice, optimal=True, solve_s=time.perf_counter() - started, **details)


def _solution(problem: StrategyProblem, choice: tuple[int, ...], **details: Any) -> StrategySolution:
    objective, memory_bytes = evaluate(problem, choice)
    return StrategySolution(choice=choice, objective=objective, memory_bytes=memory_bytes, **details)


def _axes(sizes: list[int], *kept: int) -> list[int]:
    """The shape that broadcasts an array over the variables ``kept`` along the assignment axes."""
    return [size if axis in kept else 1 for axis, size in enumerate(sizes)]


def _gib_pair(first: float, second: float) -> tuple[str, str]:
    """Both byte counts in GiB, with just enough digits (3 at least) to tell them apart."""
    digits = next((d for d in range(3, 13) if f"{first / GIB:.{d}g}" != f"{second / GIB:.{d}g}"), 12)
    return f"{first / GIB:.{digits}g}", f"{second / GIB:.{digits}g}"


def _memory_slack(problem: StrategyProblem) -> float | None:
    """B − M_min, or MemoryBudgetError naming what the smallest assignment needs when that is negative."""
    smallest, choice = smallest_memory(problem)
    budget = problem.memory_budget
    if budget is None or smallest <= budget:
        return None if budget is None else budget - smallest
    largest = max(range(len(choice)), key=lambda v: problem.node_weights[v] * problem.node_memory[v][choice[v]])
    budget_gib, smallest_gib = _gib_pair(budget, smallest)
    raise MemoryBudgetError(
        f"no sharding fits in {budget_gib} GiB per device: the smallest needs {smallest_gib} GiB "
        f"(variable with most memory: {problem.names[largest]})",
        smallest_bytes=smallest,
    )


def _fits(problem: StrategyProblem, memory_bytes: float) -> bool:
    return problem.memory_budget is None or memory_bytes <= problem.memory_budget


def _mip_start(
    problem: StrategyProblem, reduced: Reduced, incumbents: Sequence[Sequence[int]]
) -> tuple[float, tuple[int, ...]]:
    """(objective, choice): the cheapest fitting incumbent or smallest assignment, then local search from it."""
    scored = [(*evaluate(problem, choice), tuple(choice)) for choice in [*incumbents, smallest_memory(problem)[1]]]
    best = min((objective, choice) for objective, memory, choice in scored if _fits(problem, memory))
    improved = _improve_locally(problem, reduced, best[1])
    objective, memory = evaluate(problem, improved)
    return (objective, improved) if _fits(problem, memory) and objective < best[0] else best


def _improve_locally(problem: StrategyProblem, reduced: Reduced, choice: tuple[int, ...]) -> tuple[int, ...]:
    """Iterated conditional modes: sweep the free variables, moving each to its cheapest strategy given
    its neighbours' and the budget, until no move helps. Cheap, and at scale far better than any start."""
    picked, neighbours = list(choice), [[] for _ in reduced.free]
    for u, v, matrix in reduced.edges:
        neighbours[u].append((reduced.free[v], matrix))
        neighbours[v].append((reduced.free[u], matrix.T))
    budget = math.inf if problem.memory_budget is None else problem.memory_budget
    memory = evaluate(problem, choice)[1]
    for _ in range(_LOCAL_SWEEPS):
        moved = False
        for v, costs, memories, edges in zip(
            reduced.free, reduced.node_costs, reduced.node_memory, neighbours, strict=True
        ):
            local = costs + sum((matrix[:, picked[other]] for other, matrix in edges), np.zeros(len(costs)))
            after = memory + memories - memories[picked[v]]
            local[after > budget] = np.inf
            if local[best := int(np.argmin(local))] < local[picked[v]]:
                memory, picked[v], moved = float(after[best]), best, True
        if not moved:
            break
    return tuple(picked)


def solve_strategy_ilp(
    problem: StrategyProblem,
    *,
    time_limit_s: float = 30.0,
    gap: float = 0.0,
    incumbents: Sequence[tuple[int, ...]] = (),
    solver: str = "highs",
) -> StrategySolution:
    """The cheapest assignment that fits the memory budget, never worse than a fitting incumbent.

    ``gap`` is the relative MIP gap; ``solver`` "highs" (through highspy) or "cbc" (through PuLP).
    Raises MemoryBudgetError (an AutoplanError) when no assignment fits.
    """
    if solver not in _SOLVERS or time_limit_s <= 0 or gap < 0:
        raise ValueError(
            f"need solver in {_SOLVERS}, time_limit_s > 0, gap >= 0; got {solver!r}, {time_limit_s}, {gap}"
        )
    started, slack, reduced = time.perf_counter(), _memory_slack(problem), reduce_problem(problem)
    start_objective, start_choice = _mip_start(problem, reduced, incumbents)
    ilp = build_matrix(reduced, slack)
    start, built = start_vector(reduced, ilp, start_choice), time.perf_counter()
    solved = run_solver(ilp, start, solver, time_limit_s, gap) if reduced.free else (None, True, "nothing to choose")
    values, optimal, status = solved
    found = None if values is None else read_choice(problem, reduced, ilp, values)
    found_objective, found_memory = (math.inf, math.inf) if found is None else evaluate(problem, found)
    found_fits = found is not None and _fits(problem, found_memory)
    choice = found if found_fits and found_objective <= start_objective else start_choice
    if reduced.free and choice != found:
        status = f"{status}; kept the MIP start"
    sizes = {"num_variables": len(ilp.costs), "num_constraints": len(ilp.row_lower), "build_s": built - started}
    optimal = optimal and (found_fits or not reduced.free)
    return _solution(problem, choice, optimal=optimal, solve_s=time.perf_counter() - built, status=status, **sizes)


def solve_unconstrained(
    problem: StrategyProblem, *, time_limit_s: float = 30.0, incumbents: Sequence[tuple[int, ...]] = ()
) -> StrategySolution:
    """The cheapest assignment ignoring the memory budget: exact variable elimination
    (:func:`planner.intra.elimination.min_sum`), or the ILP when the elimination tables grow too wide."""
    from dataclasses import replace

    from planner.intra.elimination import min_sum

    started = time.perf_counter()
    reduced = reduce_problem(problem)
    free_choice = min_sum(reduced)
    if free_choice is None:
        return solve_strategy_ilp(
            replace(problem, memory_budget=None), time_limit_s=time_limit_s, incumbents=incumbents
        )
    choice = [int(np.argmin(costs)) if len(costs) == 1 else 0 for costs in problem.node_costs]
    for position, v in enumerate(reduced.free):
        choice[v] = free_choice[position]
    details = {"num_variables": 0, "num_constraints": 0, "build_s": 0.0, "status": "variable elimination"}
    return _solution(problem, tuple(choice), optimal=True, solve_s=time.perf_counter() - started, **details)
