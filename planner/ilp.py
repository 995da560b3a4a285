"""Choose one strategy per variable: the integer linear program of Alpa §4, solver-agnostic.

A :class:`StrategyProblem` has variables ``v`` (operators, say), each with ``k_v`` strategies,
and edges ``(u, v)`` with a cost for every pair of strategies. Write ``c_v = w_v·node_costs[v]``
and ``m_v = w_v·node_memory[v]`` (``w_v`` the variable's multiplicity), ``C_uv`` the sum of
``w_e·cost_e`` over the edges from ``u`` to ``v`` plus ``w_e·cost_eᵀ`` over those from ``v``
to ``u`` (:func:`_merge_edges`), ``B`` the memory budget. With binary ``s_v ∈ {0,1}^{k_v}``
and continuous ``e_uv ∈ ℝ_{≥0}^{k_u×k_v}`` the ILP built by :func:`_build_model` is::

    minimise  Σ_v c_v·s_v + Σ_(u,v) Σ_ij C_uv[i,j]·e_uv[i,j]              (_objective)
    s.t.      Σ_i s_v[i] = 1                             for every v       (_one_hot_rows)
              Σ_j e_uv[i,j] = s_u[i]                     for every (u,v), i (_edge_rows)
              Σ_i e_uv[i,j] = s_v[j]                     for every (u,v), j (_edge_rows)
              Σ_v (m_v − min m_v)·s_v ≤ B − M_min                          (_memory_row)

    M_min = Σ_v min_i m_v[i]                                                (smallest_memory)

``e_uv`` needs no integrality: once ``s`` is binary, the rows of ``e_uv`` outside ``s_u``'s
chosen strategy sum to zero, so the one remaining row equals ``s_v``: ``e_uv = s_u s_vᵀ``.
Declaring it binary would only widen the branching.

Reductions (:func:`_reduce`), all exact: a variable with one strategy is a constant; an edge
with one constant end adds a row or column of ``C_uv`` to the other end's ``c``; an edge whose
merged matrix is separable, ``C_uv[i,j] = a_i + b_j`` (all-zero ones included), adds ``a`` to
``c_u`` and ``b`` to ``c_v``, since the edge rows give ``Σ_ij (a_i + b_j)·e_uv[i,j] = a·s_u +
b·s_v``. Dominated strategies are kept: one cheaper and smaller than another can still lose
through its edges. Cost coefficients are scaled to at most 1 and memory to the budget slack.

The memory-minimising ILP (same rows, no budget) is separable because the edge rows hold for
any ``s``: its optimum is ``M_min`` above, and ``M_min > B`` means no assignment fits
(:func:`_raise_if_no_fit`). Incumbents (assignments known to be good) are the solver's MIP
start and are compared with its answer (:func:`_best_of`), so a time-limited solve never
returns worse. Reported objectives and memory come from :func:`evaluate`, not the solver.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import highspy
import numpy as np
import pulp

from planner.errors import AutoplanError

_GIB = 2**30
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
        for name, costs, memory in zip(self.names, self.node_costs, self.node_memory, strict=True):
            if not costs or len(costs) != len(memory):
                raise ValueError(f"{name}: needs as many memory figures as costs, and at least one")
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
    if len(choice) != len(problem.names) or any(
        not 0 <= strategy < len(costs) for strategy, costs in zip(choice, problem.node_costs, strict=True)
    ):
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
    sizes = [len(costs) for costs in problem.node_costs]
    if math.prod(sizes) > _BRUTE_FORCE_LIMIT:
        raise ValueError(f"{math.prod(sizes)} assignments are too many to enumerate")
    start = time.perf_counter()
    objective, memory = _assignment_tensors(problem, sizes)
    if problem.memory_budget is not None:
        objective = np.where(memory <= problem.memory_budget, objective, np.inf)
    if not np.isfinite(objective).any():
        return None
    choice = tuple(int(i) for i in np.unravel_index(int(np.argmin(objective)), sizes))
    value, memory_bytes = evaluate(problem, choice)
    return StrategySolution(
        choice=choice, objective=value, memory_bytes=memory_bytes, optimal=True, num_variables=0,
        num_constraints=0, build_s=0.0, solve_s=time.perf_counter() - start, status="enumerated",
    )  # fmt: skip


def _assignment_tensors(problem: StrategyProblem, sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Objective and memory of every assignment, as arrays indexed by the choice."""
    objective, memory = np.zeros(sizes), np.zeros(sizes)
    for v, weight in enumerate(problem.node_weights):
        shape = [1] * len(sizes)
        shape[v] = sizes[v]
        objective = objective + weight * np.asarray(problem.node_costs[v], dtype=float).reshape(shape)
        memory = memory + weight * np.asarray(problem.node_memory[v], dtype=float).reshape(shape)
    for edge in problem.edges:
        matrix = edge.weight * np.asarray(edge.cost, dtype=float)
        if edge.source > edge.target:
            matrix = matrix.T
        shape = [1] * len(sizes)
        shape[min(edge.source, edge.target)], shape[max(edge.source, edge.target)] = matrix.shape
        objective = objective + matrix.reshape(shape)
    return objective, memory


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
    position = {v: k for k, v in enumerate(free)}
    weights = problem.node_weights
    costs = {v: weights[v] * np.asarray(problem.node_costs[v], dtype=float) for v in free}
    edges = []
    for (u, v), matrix in _merge_edges(problem).items():
        if u in position and v in position and (parts := _separable_parts(matrix)) is None:
            edges.append((position[u], position[v], matrix))
        elif u in position and v in position:
            costs[u], costs[v] = costs[u] + parts[0], costs[v] + parts[1]
        elif u in position:
            costs[u] = costs[u] + matrix[:, 0]
        elif v in position:
            costs[v] = costs[v] + matrix[0, :]
    memory = tuple(weights[v] * np.asarray(problem.node_memory[v], dtype=float) for v in free)
    if not all(np.isfinite(c).all() for c in costs.values()) or not all(np.isfinite(m).all() for m in memory):
        raise ValueError("costs and memory must be finite")
    return _Reduced(free=free, node_costs=tuple(costs[v] for v in free), node_memory=memory, edges=tuple(edges))


def _gib_pair(first: float, second: float) -> tuple[str, str]:
    """Both byte counts in GiB, with just enough digits to tell them apart."""
    for digits in range(3, 13):
        pair = (f"{first / _GIB:.{digits}g}", f"{second / _GIB:.{digits}g}")
        if pair[0] != pair[1]:
            break
    return pair


def _raise_if_no_fit(problem: StrategyProblem) -> tuple[int, ...]:
    """The smallest assignment, or MemoryBudgetError naming what it needs when even it exceeds the budget."""
    smallest, choice = smallest_memory(problem)
    budget = problem.memory_budget
    if budget is None or smallest <= budget:
        return choice
    largest = max(range(len(choice)), key=lambda v: problem.node_weights[v] * problem.node_memory[v][choice[v]])
    budget_gib, smallest_gib = _gib_pair(budget, smallest)
    raise MemoryBudgetError(
        f"no sharding fits in {budget_gib} GiB per device: the smallest needs {smallest_gib} GiB "
        f"(variable with most memory: {problem.names[largest]})",
        smallest_bytes=smallest,
    )


@dataclass(frozen=True, kw_only=True)
class _MatrixIlp:
    """The ILP in solver-neutral sparse form: columns s (binary) then e (continuous), rows in CSR."""

    costs: np.ndarray  # objective per column, scaled so the largest magnitude is 1
    num_binary: int  # the first columns are the s, binary; the rest are the e, in [0, inf)
    choice_columns: tuple[int, ...]  # first column of each free variable's s
    edge_columns: tuple[int, ...]  # first column of each kept edge's e, row-major
    starts: np.ndarray
    indices: np.ndarray
    values: np.ndarray
    row_lower: np.ndarray
    row_upper: np.ndarray


_RowBlock = tuple[np.ndarray, np.ndarray, float, float]  # columns and coefficients (one row each), bounds


def _first_columns(sizes: list[int], offset: int) -> tuple[int, ...]:
    return tuple(offset + int(total) for total in np.cumsum([0, *sizes])[:-1])


def _build_matrix(reduced: _Reduced, memory_slack: float | None) -> _MatrixIlp:
    sizes = [len(costs) for costs in reduced.node_costs]
    choice_columns = _first_columns(sizes, 0)
    edge_columns = _first_columns([matrix.size for _, _, matrix in reduced.edges], sum(sizes))
    blocks = [*_one_hot_rows(choice_columns, sizes), *_edge_rows(reduced, choice_columns, edge_columns)]
    blocks += _memory_row(reduced, choice_columns, memory_slack)
    lengths = [columns.shape[1] for columns, _, _, _ in blocks for _ in range(columns.shape[0])]
    return _MatrixIlp(
        costs=_objective(reduced), num_binary=sum(sizes), choice_columns=choice_columns, edge_columns=edge_columns,
        starts=np.cumsum([0, *lengths])[:-1].astype(np.int32),
        indices=np.concatenate([columns.ravel() for columns, _, _, _ in blocks]).astype(np.int32),
        values=np.concatenate([coefficients.ravel() for _, coefficients, _, _ in blocks]).astype(float),
        row_lower=np.concatenate([np.full(columns.shape[0], lower) for columns, _, lower, _ in blocks]),
        row_upper=np.concatenate([np.full(columns.shape[0], upper) for columns, _, _, upper in blocks]),
    )  # fmt: skip


def _objective(reduced: _Reduced) -> np.ndarray:
    """c_v for every s, then C_uv for every e; scaled so the largest magnitude is 1."""
    costs = np.concatenate([*reduced.node_costs, *(matrix.ravel() for _, _, matrix in reduced.edges)])
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
    """Σ (m_v − min m_v)·s_v ≤ B − M_min, scaled to coefficients ≤ 1; none when even the largest choice fits.

    The bound is lowered by the solver's feasibility tolerance, so what it accepts truly fits.
    """
    extras = [memory - memory.min() for memory in reduced.node_memory]
    if slack is None or sum(float(extra.max()) for extra in extras) <= slack:
        return []
    coefficients = np.concatenate(extras)
    scale = float(coefficients.max())
    columns = np.concatenate(
        [first + np.arange(len(extra)) for first, extra in zip(choice_columns, extras, strict=True)]
    )
    used = coefficients > 0
    upper = max(slack / scale - _FEASIBILITY_TOLERANCE, 0.0)
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
    """HiGHS through highspy, the matrix passed in bulk and the start as MIP start."""
    highs = highspy.Highs()
    for option, value in (("output_flag", False), ("time_limit", float(time_limit_s)), ("mip_rel_gap", float(gap))):
        highs.setOptionValue(option, value)
    count, no_entries = len(ilp.costs), np.zeros(len(ilp.costs), dtype=np.int32)
    upper = np.where(np.arange(count) < ilp.num_binary, 1.0, highspy.kHighsInf)
    highs.addCols(count, ilp.costs, np.zeros(count), upper, 0, no_entries, no_entries[:0], ilp.costs[:0])
    binary = np.arange(ilp.num_binary, dtype=np.int32)
    highs.changeColsIntegrality(ilp.num_binary, binary, np.ones(ilp.num_binary, dtype=np.uint8))
    highs.addRows(
        len(ilp.row_lower), ilp.row_lower, ilp.row_upper, len(ilp.indices), ilp.starts, ilp.indices, ilp.values
    )
    highs.setSolution(count, np.arange(count, dtype=np.int32), start)
    highs.run()
    status, solution = highs.getModelStatus(), highs.getSolution()
    values = np.asarray(solution.col_value) if solution.value_valid else None
    return values, status == highspy.HighsModelStatus.kOptimal, highs.modelStatusToString(status)


def _solve_pulp(ilp: _MatrixIlp, start: np.ndarray, solver: pulp.LpSolver) -> _Outcome:
    """Any PuLP solver: the matrix rebuilt as an LpProblem, the start as initial values."""
    lp = pulp.LpProblem("strategies", pulp.LpMinimize)
    columns = [
        pulp.LpVariable(f"x{k}", lowBound=0, cat=pulp.LpBinary if k < ilp.num_binary else pulp.LpContinuous)
        for k in range(len(ilp.costs))
    ]
    lp.setObjective(pulp.LpAffineExpression([(columns[k], c) for k, c in enumerate(ilp.costs.tolist()) if c != 0.0]))
    ends = [*ilp.starts.tolist()[1:], len(ilp.indices)]
    for row, (begin, end) in enumerate(zip(ilp.starts.tolist(), ends, strict=True)):
        terms = [
            (columns[k], c)
            for k, c in zip(ilp.indices[begin:end].tolist(), ilp.values[begin:end].tolist(), strict=True)
        ]
        equal = ilp.row_lower[row] == ilp.row_upper[row]
        sense = pulp.LpConstraintEQ if equal else pulp.LpConstraintLE
        lp.addConstraint(
            pulp.LpConstraint(pulp.LpAffineExpression(terms), sense=sense, rhs=float(ilp.row_upper[row])), f"r{row}"
        )
    for column, value in zip(columns, start.tolist(), strict=True):
        column.setInitialValue(value)
    lp.solve(solver)
    values = [column.varValue for column in columns]
    found = None if None in values else np.array(values, dtype=float)
    return found, lp.sol_status == pulp.LpSolutionOptimal, pulp.LpSolution[lp.sol_status]


def _pulp_solver(solver: str, time_limit_s: float, gap: float) -> pulp.LpSolver:
    if solver == "cbc":
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=gap, warmStart=True)
    if solver == "pulp-highs":  # pulp.HiGHS takes no MIP start: incumbents are only compared afterwards
        return pulp.HiGHS(msg=False, timeLimit=time_limit_s, gapRel=gap)
    raise ValueError(f"unknown solver {solver!r}: use 'highs', 'cbc' or 'pulp-highs'")


def _fits(problem: StrategyProblem, memory_bytes: float) -> bool:
    return problem.memory_budget is None or memory_bytes <= problem.memory_budget


def solve_strategy_ilp(
    problem: StrategyProblem,
    *,
    time_limit_s: float = 30.0,
    gap: float = 0.0,
    incumbents: Sequence[tuple[int, ...]] = (),
    solver: str = "highs",
) -> StrategySolution:
    """The cheapest assignment that fits the memory budget, never worse than a fitting incumbent.

    ``gap`` is the relative MIP gap; ``solver`` is "highs" (highspy), "cbc" or "pulp-highs" (through PuLP).
    Raises MemoryBudgetError (an AutoplanError) when no assignment fits.
    """
    started = time.perf_counter()
    smallest = _raise_if_no_fit(problem)
    known = [(*evaluate(problem, choice), tuple(choice)) for choice in [*incumbents, smallest]]
    best_known = min((entry for entry in known if _fits(problem, entry[1])), key=lambda entry: entry[0])
    reduced = _reduce(problem)
    slack = None if problem.memory_budget is None else problem.memory_budget - evaluate(problem, smallest)[1]
    ilp = _build_matrix(reduced, slack)
    start = _start_vector(reduced, ilp, best_known[2])
    built = time.perf_counter()
    values, optimal, status = None, True, "nothing to choose"
    if reduced.free and solver == "highs":
        values, optimal, status = _solve_highs(ilp, start, time_limit_s, gap)
    elif reduced.free:
        values, optimal, status = _solve_pulp(ilp, start, _pulp_solver(solver, time_limit_s, gap))
    found = [] if values is None else [(*evaluate(problem, c := _read_choice(problem, reduced, ilp, values)), c)]
    found = [entry for entry in found if _fits(problem, entry[1])]
    objective, memory_bytes, choice = min([*found, best_known], key=lambda entry: entry[0])
    if reduced.free and (not found or choice != found[0][2]):
        status = f"{status}; returned an incumbent"
    return StrategySolution(
        choice=choice, objective=objective, memory_bytes=memory_bytes, optimal=optimal and (bool(found) or not reduced.free),
        num_variables=len(ilp.costs), num_constraints=len(ilp.row_lower), build_s=built - started,
        solve_s=time.perf_counter() - built, status=status,
    )  # fmt: skip
