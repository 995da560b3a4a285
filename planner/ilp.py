"""Choose one strategy per variable: the integer linear program of Alpa §4, solver-agnostic.

A :class:`StrategyProblem` has variables ``v`` (operators, say), each with ``k_v`` strategies,
and edges ``(u, v)`` with a cost for every pair of strategies. Write ``c_v = w_v·node_costs[v]``
and ``m_v = w_v·node_memory[v]`` (``w_v`` the variable's multiplicity), ``C_uv`` the sum of
``w_e·cost_e`` over the edges from ``u`` to ``v`` plus ``w_e·cost_eᵀ`` over those from ``v``
to ``u`` (:func:`_merge_edges`), ``B`` the memory budget. With binary ``s_v ∈ {0,1}^{k_v}``
and continuous ``e_uv ∈ ℝ_{≥0}^{k_u×k_v}``, :func:`_build_matrix` builds::

    minimise  Σ_v c_v·s_v + Σ_(u,v) Σ_ij C_uv[i,j]·e_uv[i,j]               (_objective)
    s.t.      Σ_i s_v[i] = 1                             for every v        (_one_hot_rows)
              Σ_j e_uv[i,j] = s_u[i]                     for every (u,v), i (_edge_rows)
              Σ_i e_uv[i,j] = s_v[j]                     for every (u,v), j (_edge_rows)
              Σ_v (m_v − min m_v)·s_v ≤ B − M_min                           (_memory_row)

    M_min = Σ_v min_i m_v[i]                                                 (smallest_memory)

``e_uv`` needs no integrality: once ``s`` is binary, the rows of ``e_uv`` other than ``s_u``'s
chosen one sum to zero, so that one row equals ``s_v``: ``e_uv = s_u s_vᵀ``. Declaring it
binary would only widen the branching.

Reductions (:func:`_reduce`), all exact: a variable with one strategy is a constant; an edge
with one constant end adds a row or column of ``C_uv`` to the other end's ``c``; an edge whose
merged matrix is separable, ``C_uv[i,j] = a_i + b_j`` (all-zero ones included), adds ``a`` to
``c_u`` and ``b`` to ``c_v``, since the edge rows give ``Σ_ij (a_i + b_j)·e_uv[i,j] = a·s_u +
b·s_v``. Dominated strategies are kept: one cheaper and smaller than another can still lose
through its edges. Costs are scaled to at most 1, memory to the largest ``m_v − min m_v``.

The memory-minimising ILP (same rows, no budget) is separable because the edge rows hold for
any ``s``: its optimum is ``M_min``, and ``M_min > B`` means nothing fits (:func:`_memory_slack`).
The MIP start is the cheapest fitting one of the incumbents and the smallest assignment; the
solver's answer replaces it only if no dearer, so a time-limited solve never returns worse
(:func:`solve_strategy_ilp`). Objectives and memory reported come from :func:`evaluate`.

The sparse matrix goes to HiGHS in bulk through highspy (:func:`_solve_highs`): building PuLP
objects costs seconds per 100k columns, and ``pulp.HiGHS`` passes no MIP start. ``solver="cbc"``
rebuilds the same matrix in PuLP (:func:`_solve_pulp`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import highspy
import numpy as np
import pulp

from planner.errors import AutoplanError

_GIB = 2**30
_SOLVERS = ("highs", "cbc")  # HiGHS through highspy, CBC through PuLP
_SEPARABLE_TOLERANCE = 1e-12
_FEASIBILITY_TOLERANCE = 1e-6  # HiGHS's and CBC's default for rows
_BRUTE_FORCE_LIMIT = 2_000_000


@dataclass(frozen=True, kw_only=True)
class StrategyEdge:
    """Cost ``cost[i][j]`` seconds when ``source`` takes strategy ``i`` and ``target`` takes ``j``."""

    source: int
    target: int
    cost: tuple[tuple[float, ...], ...]
    weight: float = 1.0


@dataclass(frozen=True, kw_only=True)
class StrategyProblem:
    """Variables with per-strategy costs and memory, edges between them, a memory budget per device."""

    names: tuple[str, ...]
    node_costs: tuple[tuple[float, ...], ...]
    node_memory: tuple[tuple[float, ...], ...]
    node_weights: tuple[float, ...]
    edges: tuple[StrategyEdge, ...]
    memory_budget: float | None

    def __post_init__(self) -> None:
        count = len(self.names)
        if not len(self.node_costs) == len(self.node_memory) == len(self.node_weights) == count:
            raise ValueError("names, node_costs, node_memory and node_weights differ in length")
        for name, costs, memory, weight in zip(
            self.names, self.node_costs, self.node_memory, self.node_weights, strict=True
        ):
            if not costs or len(costs) != len(memory) or weight < 0:
                raise ValueError(f"{name}: needs a weight >= 0 and as many memory figures as costs, at least one")
        for edge in self.edges:
            if not (0 <= edge.source < count and 0 <= edge.target < count) or edge.source == edge.target:
                raise ValueError(f"edge {edge.source}->{edge.target} joins no two distinct variables")
            rows, columns = len(self.node_costs[edge.source]), len(self.node_costs[edge.target])
            if len(edge.cost) != rows or any(len(row) != columns for row in edge.cost):
                raise ValueError(f"edge {edge.source}->{edge.target}: cost is not {rows}x{columns}")


@dataclass(frozen=True, kw_only=True)
class StrategySolution:
    """The chosen strategy per variable, its evaluated cost and memory, and how the solve went."""

    choice: tuple[int, ...]
    objective: float
    memory_bytes: float
    optimal: bool
    num_variables: int
    num_constraints: int
    build_s: float
    solve_s: float
    status: str


class MemoryBudgetError(AutoplanError):
    """No assignment fits the memory budget; ``smallest_bytes`` is what the smallest one needs."""

    def __init__(self, message: str, *, smallest_bytes: float) -> None:
        super().__init__(message)
        self.smallest_bytes = smallest_bytes


def evaluate(problem: StrategyProblem, choice: Sequence[int]) -> tuple[float, float]:
    """(objective seconds, memory bytes per device) of one assignment, summed exactly in Python."""
    sizes = [len(costs) for costs in problem.node_costs]
    if len(choice) != len(sizes) or any(not 0 <= i < size for i, size in zip(choice, sizes, strict=True)):
        raise ValueError(f"choice {tuple(choice)} does not pick one valid strategy per variable")
    weights = problem.node_weights
    node_terms = [w * costs[i] for w, costs, i in zip(weights, problem.node_costs, choice, strict=True)]
    edge_terms = [e.weight * e.cost[choice[e.source]][choice[e.target]] for e in problem.edges]
    memory_terms = [w * memory[i] for w, memory, i in zip(weights, problem.node_memory, choice, strict=True)]
    return math.fsum(node_terms + edge_terms), math.fsum(memory_terms)


def smallest_memory(problem: StrategyProblem) -> tuple[float, tuple[int, ...]]:
    """``M_min`` (bytes per device) and the assignment reaching it: each variable's smallest strategy."""
    choice = tuple(int(np.argmin(memory)) for memory in problem.node_memory)
    return evaluate(problem, choice)[1], choice


def brute_force(problem: StrategyProblem) -> StrategySolution | None:
    """The optimum by enumerating every assignment (small problems, for tests); None if none fits."""
    started, sizes = time.perf_counter(), [len(costs) for costs in problem.node_costs]
    if math.prod(sizes) > _BRUTE_FORCE_LIMIT:
        raise ValueError(f"{math.prod(sizes)} assignments are too many to enumerate")
    objective, memory = np.zeros(sizes), np.zeros(sizes)  # indexed by the choice
    for v, weight in enumerate(problem.node_weights):
        objective = objective + weight * np.asarray(problem.node_costs[v]).reshape(_axes(sizes, v))
        memory = memory + weight * np.asarray(problem.node_memory[v]).reshape(_axes(sizes, v))
    for (u, v), matrix in _merge_edges(problem).items():
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


@dataclass(frozen=True, kw_only=True)
class _Reduced:
    """The problem as the ILP sees it: free variables only, weights applied, edges merged and folded."""

    free: tuple[int, ...]  # indices of the variables with more than one strategy
    node_costs: tuple[np.ndarray, ...]  # c_v per free variable, folded edges included
    node_memory: tuple[np.ndarray, ...]  # m_v per free variable
    edges: tuple[tuple[int, int, np.ndarray], ...]  # (position of u in free, of v, C_uv)


def _merge_edges(problem: StrategyProblem) -> dict[tuple[int, int], np.ndarray]:
    """C_uv keyed by (u, v) with u < v: weighted cost matrices summed, reversed edges transposed."""
    merged: dict[tuple[int, int], np.ndarray] = {}
    for edge in problem.edges:
        matrix = edge.weight * np.asarray(edge.cost, dtype=float)
        key = (edge.source, edge.target)
        if edge.source > edge.target:
            key, matrix = (edge.target, edge.source), matrix.T
        merged[key] = merged[key] + matrix if key in merged else matrix
    return merged


def _separable_parts(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(a, b) with matrix[i, j] = a[i] + b[j], or None when the matrix has no such split."""
    rows, columns = matrix[:, 0], matrix[0, :] - matrix[0, 0]
    residual = matrix - rows[:, None] - columns[None, :]
    scale = float(np.abs(matrix).max())
    return (rows, columns) if float(np.abs(residual).max()) <= _SEPARABLE_TOLERANCE * scale else None


def _reduce(problem: StrategyProblem) -> _Reduced:
    """Drop constant variables, fold edges into node costs where exact, keep the rest as edges."""
    free = tuple(v for v, costs in enumerate(problem.node_costs) if len(costs) > 1)
    position, weights = {v: k for k, v in enumerate(free)}, problem.node_weights
    costs = {v: weights[v] * np.asarray(problem.node_costs[v], dtype=float) for v in free}
    merged, edges = _merge_edges(problem), []
    for (u, v), matrix in merged.items():
        if u in position and v in position and (parts := _separable_parts(matrix)) is None:
            edges.append((position[u], position[v], matrix))
        elif u in position and v in position:
            costs[u], costs[v] = costs[u] + parts[0], costs[v] + parts[1]
        elif u in position:
            costs[u] = costs[u] + matrix[:, 0]
        elif v in position:
            costs[v] = costs[v] + matrix[0, :]
    memory = tuple(weights[v] * np.asarray(problem.node_memory[v], dtype=float) for v in free)
    if not all(np.isfinite(array).all() for array in [*costs.values(), *memory, *merged.values()]):
        raise ValueError("costs and memory must be finite")
    return _Reduced(free=free, node_costs=tuple(costs[v] for v in free), node_memory=memory, edges=tuple(edges))


def _gib_pair(first: float, second: float) -> tuple[str, str]:
    """Both byte counts in GiB, with just enough digits (3 at least) to tell them apart."""
    digits = next((d for d in range(3, 13) if f"{first / _GIB:.{d}g}" != f"{second / _GIB:.{d}g}"), 12)
    return f"{first / _GIB:.{digits}g}", f"{second / _GIB:.{digits}g}"


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


@dataclass(frozen=True, kw_only=True)
class _MatrixIlp:
    """The ILP in solver-neutral sparse form: columns s (binary) then e (in [0, inf)), rows in CSR."""

    costs: np.ndarray
    num_binary: int
    choice_columns: tuple[int, ...]  # first column of each free variable's s
    edge_columns: tuple[int, ...]  # first column of each kept edge's e, row-major
    starts: np.ndarray
    indices: np.ndarray
    values: np.ndarray
    row_lower: np.ndarray
    row_upper: np.ndarray


_RowBlock = tuple[np.ndarray, np.ndarray, float, float]  # columns, coefficients (a row each), lower, upper


def _build_matrix(reduced: _Reduced, memory_slack: float | None) -> _MatrixIlp:
    sizes = [len(costs) for costs in reduced.node_costs]
    edge_sizes = [matrix.size for _, _, matrix in reduced.edges]
    choice_columns = tuple(np.cumsum([0, *sizes])[:-1].tolist())
    edge_columns = tuple((sum(sizes) + np.cumsum([0, *edge_sizes])[:-1]).tolist())
    blocks = [*_one_hot_rows(choice_columns, sizes), *_edge_rows(reduced, choice_columns, edge_columns)]
    blocks += _memory_row(reduced, choice_columns, memory_slack)
    lengths = [columns.shape[1] for columns, _, _, _ in blocks for _ in columns]
    return _MatrixIlp(
        costs=_objective(reduced),
        num_binary=sum(sizes),
        choice_columns=choice_columns,
        edge_columns=edge_columns,
        starts=np.cumsum([0, *lengths])[:-1].astype(np.int32),
        indices=np.concatenate([np.zeros(0), *(columns.ravel() for columns, _, _, _ in blocks)]).astype(np.int32),
        values=np.concatenate([np.zeros(0), *(coefficients.ravel() for _, coefficients, _, _ in blocks)]),
        row_lower=np.concatenate([np.zeros(0), *(np.full(len(columns), lower) for columns, _, lower, _ in blocks)]),
        row_upper=np.concatenate([np.zeros(0), *(np.full(len(columns), upper) for columns, _, _, upper in blocks)]),
    )


def _objective(reduced: _Reduced) -> np.ndarray:
    """c_v for every s, then C_uv for every e; scaled so the largest magnitude is 1."""
    costs = np.concatenate([np.zeros(0), *reduced.node_costs, *(matrix.ravel() for _, _, matrix in reduced.edges)])
    scale = float(np.abs(costs).max()) if costs.size else 0.0
    return costs / scale if scale > 0 else costs


def _one_hot_rows(choice_columns: tuple[int, ...], sizes: list[int]) -> list[_RowBlock]:
    return [
        (first + np.arange(size)[None, :], np.ones((1, size)), 1.0, 1.0)
        for first, size in zip(choice_columns, sizes, strict=True)
    ]


def _edge_rows(reduced: _Reduced, choice_columns: tuple[int, ...], edge_columns: tuple[int, ...]) -> list[_RowBlock]:
    """Σ_j e_uv[i,j] − s_u[i] = 0 and Σ_i e_uv[i,j] − s_v[j] = 0: a block of rows per edge and side."""
    blocks = []
    for (u, v, matrix), first in zip(reduced.edges, edge_columns, strict=True):
        grid = first + np.arange(matrix.size).reshape(matrix.shape)
        for cells, choice_column in ((grid, choice_columns[u]), (grid.T, choice_columns[v])):
            own = choice_column + np.arange(cells.shape[0])[:, None]
            coefficients = np.hstack([np.ones(cells.shape), -np.ones(own.shape)])
            blocks.append((np.hstack([cells, own]), coefficients, 0.0, 0.0))
    return blocks


def _memory_row(reduced: _Reduced, choice_columns: tuple[int, ...], slack: float | None) -> list[_RowBlock]:
    """Σ (m_v − min m_v)·s_v ≤ B − M_min, none when even the largest choice fits. The bound is lowered
    by the solver's feasibility tolerance, so what the solver accepts truly fits."""
    extras = [memory - memory.min() for memory in reduced.node_memory]
    if slack is None or sum(float(extra.max()) for extra in extras) <= slack:
        return []
    coefficients, scale = np.concatenate(extras), max(float(extra.max()) for extra in extras)
    columns = np.concatenate(
        [first + np.arange(len(extra)) for first, extra in zip(choice_columns, extras, strict=True)]
    )
    used, upper = coefficients > 0, max(slack / scale - _FEASIBILITY_TOLERANCE, 0.0)
    return [(columns[used][None, :], coefficients[used][None, :] / scale, -np.inf, upper)]


def _start_vector(reduced: _Reduced, ilp: _MatrixIlp, choice: tuple[int, ...]) -> np.ndarray:
    """The MIP start: s and e of one assignment."""
    start = np.zeros(len(ilp.costs))
    for v, first in zip(reduced.free, ilp.choice_columns, strict=True):
        start[first + choice[v]] = 1.0
    for (u, v, matrix), first in zip(reduced.edges, ilp.edge_columns, strict=True):
        start[first + choice[reduced.free[u]] * matrix.shape[1] + choice[reduced.free[v]]] = 1.0
    return start


def _read_choice(problem: StrategyProblem, reduced: _Reduced, ilp: _MatrixIlp, values: np.ndarray) -> tuple[int, ...]:
    """The solver's assignment; constant variables take their only strategy."""
    choice = [0] * len(problem.names)
    for v, first, costs in zip(reduced.free, ilp.choice_columns, reduced.node_costs, strict=True):
        choice[v] = int(np.argmax(values[first : first + len(costs)]))
    return tuple(choice)


_Outcome = tuple[np.ndarray | None, bool, str]  # column values (None: no solution), proved optimal, status


def _solve_highs(ilp: _MatrixIlp, start: np.ndarray, time_limit_s: float, gap: float) -> _Outcome:
    """HiGHS through highspy: the matrix passed in bulk, the start as MIP start."""
    highs, count = highspy.Highs(), len(ilp.costs)
    for option, value in (("output_flag", False), ("time_limit", float(time_limit_s)), ("mip_rel_gap", float(gap))):
        highs.setOptionValue(option, value)
    upper, no_entries = np.where(np.arange(count) < ilp.num_binary, 1.0, highspy.kHighsInf), np.zeros(count, np.int32)
    highs.addCols(count, ilp.costs, np.zeros(count), upper, 0, no_entries, no_entries[:0], ilp.costs[:0])
    binary = np.arange(ilp.num_binary, dtype=np.int32)
    highs.changeColsIntegrality(ilp.num_binary, binary, np.ones(ilp.num_binary, dtype=np.uint8))
    highs.addRows(
        len(ilp.row_lower), ilp.row_lower, ilp.row_upper, len(ilp.values), ilp.starts, ilp.indices, ilp.values
    )
    highs.setSolution(count, np.arange(count, dtype=np.int32), start)
    highs.run()
    status, solution, relative_gap = highs.getModelStatus(), highs.getSolution(), highs.getInfo().mip_gap
    optimal, text = status == highspy.HighsModelStatus.kOptimal, highs.modelStatusToString(status)
    text += "" if optimal or not math.isfinite(relative_gap) else f" (gap {relative_gap:.2%})"
    return (np.asarray(solution.col_value) if solution.value_valid else None), optimal, text


def _solve_pulp(ilp: _MatrixIlp, start: np.ndarray, solver: pulp.LpSolver) -> _Outcome:
    """Any PuLP solver: the matrix rebuilt as an LpProblem (x_k for column k), the start as initial values."""
    lp = pulp.LpProblem("strategies", pulp.LpMinimize)
    kinds = [pulp.LpBinary] * ilp.num_binary + [pulp.LpContinuous] * (len(ilp.costs) - ilp.num_binary)
    columns = [pulp.LpVariable(f"x{k}", lowBound=0, cat=kind) for k, kind in enumerate(kinds)]
    lp.setObjective(pulp.LpAffineExpression([(columns[k], c) for k, c in enumerate(ilp.costs.tolist()) if c != 0.0]))
    entries = list(zip(ilp.indices.tolist(), ilp.values.tolist(), strict=True))
    ends = [*ilp.starts.tolist()[1:], len(entries)]
    for row, (begin, end) in enumerate(zip(ilp.starts.tolist(), ends, strict=True)):
        terms = pulp.LpAffineExpression([(columns[k], c) for k, c in entries[begin:end]])
        sense = pulp.LpConstraintEQ if ilp.row_lower[row] == ilp.row_upper[row] else pulp.LpConstraintLE
        lp.addConstraint(pulp.LpConstraint(terms, sense=sense, rhs=float(ilp.row_upper[row])), f"r{row}")
    for column, value in zip(columns, start.tolist(), strict=True):
        column.setInitialValue(value)
    lp.solve(solver)
    values = [column.varValue for column in columns]
    found = None if None in values else np.array(values, dtype=float)
    return found, lp.sol_status == pulp.LpSolutionOptimal, pulp.LpSolution[lp.sol_status]


def _fits(problem: StrategyProblem, memory_bytes: float) -> bool:
    return problem.memory_budget is None or memory_bytes <= problem.memory_budget


def _mip_start(problem: StrategyProblem, incumbents: Sequence[Sequence[int]]) -> tuple[float, tuple[int, ...]]:
    """(objective, choice) of the cheapest fitting one of the incumbents and the smallest assignment."""
    scored = [(*evaluate(problem, choice), tuple(choice)) for choice in [*incumbents, smallest_memory(problem)[1]]]
    return min((objective, choice) for objective, memory, choice in scored if _fits(problem, memory))


def _run_solver(ilp: _MatrixIlp, start: np.ndarray, solver: str, time_limit_s: float, gap: float) -> _Outcome:
    if solver == "highs":
        return _solve_highs(ilp, start, time_limit_s, gap)
    return _solve_pulp(ilp, start, pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=gap, warmStart=True))


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
    started, slack, reduced = time.perf_counter(), _memory_slack(problem), _reduce(problem)
    start_objective, start_choice = _mip_start(problem, incumbents)
    ilp = _build_matrix(reduced, slack)
    start, built = _start_vector(reduced, ilp, start_choice), time.perf_counter()
    solved = _run_solver(ilp, start, solver, time_limit_s, gap) if reduced.free else (None, True, "nothing to choose")
    values, optimal, status = solved
    found = None if values is None else _read_choice(problem, reduced, ilp, values)
    found_objective, found_memory = (math.inf, math.inf) if found is None else evaluate(problem, found)
    found_fits = found is not None and _fits(problem, found_memory)
    choice = found if found_fits and found_objective <= start_objective else start_choice
    if reduced.free and choice != found:
        status = f"{status}; kept the MIP start"
    sizes = {"num_variables": len(ilp.costs), "num_constraints": len(ilp.row_lower), "build_s": built - started}
    optimal = optimal and (found_fits or not reduced.free)
    return _solution(problem, choice, optimal=optimal, solve_s=time.perf_counter() - built, status=status, **sizes)
