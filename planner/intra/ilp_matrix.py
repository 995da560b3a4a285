"""The strategy ILP in matrix form, and the solvers that take it (see :mod:`planner.intra.problem`).

:func:`reduce_problem` applies the exact reductions (constant variables, merged and folded
edges); :func:`build_matrix` writes the one-hot, edge-consistency and memory rows as a sparse
matrix; :func:`run_solver` hands it to HiGHS through highspy (the default: the matrix in bulk,
the incumbent as MIP start) or to CBC through PuLP (with ``warmStart``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import highspy
import numpy as np
import pulp

if TYPE_CHECKING:
    from planner.intra.problem import StrategyProblem

_SEPARABLE_TOLERANCE = 1e-12
_FEASIBILITY_TOLERANCE = 1e-6  # HiGHS's and CBC's default for rows


@dataclass(frozen=True, kw_only=True)
class Reduced:
    """The problem as the ILP sees it: free variables only, weights applied, edges merged and folded."""

    free: tuple[int, ...]  # indices of the variables with more than one strategy
    node_costs: tuple[np.ndarray, ...]  # c_v per free variable, folded edges included
    node_memory: tuple[np.ndarray, ...]  # m_v per free variable
    edges: tuple[tuple[int, int, np.ndarray], ...]  # (position of u in free, of v, C_uv)


def merge_edges(problem: StrategyProblem) -> dict[tuple[int, int], np.ndarray]:
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


def reduce_problem(problem: StrategyProblem) -> Reduced:
    """Drop constant variables, fold edges into node costs where exact, keep the rest as edges."""
    free = tuple(v for v, costs in enumerate(problem.node_costs) if len(costs) > 1)
    position, weights = {v: k for k, v in enumerate(free)}, problem.node_weights
    costs = {v: weights[v] * np.asarray(problem.node_costs[v], dtype=float) for v in free}
    merged, edges = merge_edges(problem), []
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
    return Reduced(free=free, node_costs=tuple(costs[v] for v in free), node_memory=memory, edges=tuple(edges))


@dataclass(frozen=True, kw_only=True)
class MatrixIlp:
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


def build_matrix(reduced: Reduced, memory_slack: float | None) -> MatrixIlp:
    sizes = [len(costs) for costs in reduced.node_costs]
    edge_sizes = [matrix.size for _, _, matrix in reduced.edges]
    choice_columns = tuple(np.cumsum([0, *sizes])[:-1].tolist())
    edge_columns = tuple((sum(sizes) + np.cumsum([0, *edge_sizes])[:-1]).tolist())
    blocks = [*_one_hot_rows(choice_columns, sizes), *_edge_rows(reduced, choice_columns, edge_columns)]
    blocks += _memory_row(reduced, choice_columns, memory_slack)
    lengths = [columns.shape[1] for columns, _, _, _ in blocks for _ in columns]
    return MatrixIlp(
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


def _objective(reduced: Reduced) -> np.ndarray:
    """c_v for every s, then C_uv for every e; scaled so the largest magnitude is 1."""
    costs = np.concatenate([np.zeros(0), *reduced.node_costs, *(matrix.ravel() for _, _, matrix in reduced.edges)])
    scale = float(np.abs(costs).max()) if costs.size else 0.0
    return costs / scale if scale > 0 else costs


def _one_hot_rows(choice_columns: tuple[int, ...], sizes: list[int]) -> list[_RowBlock]:
    return [
        (first + np.arange(size)[None, :], np.ones((1, size)), 1.0, 1.0)
        for first, size in zip(choice_columns, sizes, strict=True)
    ]


def _edge_rows(reduced: Reduced, choice_columns: tuple[int, ...], edge_columns: tuple[int, ...]) -> list[_RowBlock]:
    """Σ_j e_uv[i,j] − s_u[i] = 0 and Σ_i e_uv[i,j] − s_v[j] = 0: a block of rows per edge and side."""
    blocks = []
    for (u, v, matrix), first in zip(reduced.edges, edge_columns, strict=True):
        grid = first + np.arange(matrix.size).reshape(matrix.shape)
        for cells, choice_column in ((grid, choice_columns[u]), (grid.T, choice_columns[v])):
            own = choice_column + np.arange(cells.shape[0])[:, None]
            coefficients = np.hstack([np.ones(cells.shape), -np.ones(own.shape)])
            blocks.append((np.hstack([cells, own]), coefficients, 0.0, 0.0))
    return blocks


def _memory_row(reduced: Reduced, choice_columns: tuple[int, ...], slack: float | None) -> list[_RowBlock]:
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


def start_vector(reduced: Reduced, ilp: MatrixIlp, choice: tuple[int, ...]) -> np.ndarray:
    """The MIP start: s and e of one assignment."""
    start = np.zeros(len(ilp.costs))
    for v, first in zip(reduced.free, ilp.choice_columns, strict=True):
        start[first + choice[v]] = 1.0
    for (u, v, matrix), first in zip(reduced.edges, ilp.edge_columns, strict=True):
        start[first + choice[reduced.free[u]] * matrix.shape[1] + choice[reduced.free[v]]] = 1.0
    return start


def read_choice(problem: StrategyProblem, reduced: Reduced, ilp: MatrixIlp, values: np.ndarray) -> tuple[int, ...]:
    """The solver's assignment; constant variables take their only strategy."""
    choice = [0] * len(problem.names)
    for v, first, costs in zip(reduced.free, ilp.choice_columns, reduced.node_costs, strict=True):
        choice[v] = int(np.argmax(values[first : first + len(costs)]))
    return tuple(choice)


_Outcome = tuple[np.ndarray | None, bool, str]  # column values (None: no solution), proved optimal, status


def _solve_highs(ilp: MatrixIlp, start: np.ndarray, time_limit_s: float, gap: float) -> _Outcome:
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


def _solve_pulp(ilp: MatrixIlp, start: np.ndarray, solver: pulp.LpSolver) -> _Outcome:
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


def run_solver(ilp: MatrixIlp, start: np.ndarray, solver: str, time_limit_s: float, gap: float) -> _Outcome:
    if solver == "highs":
        return _solve_highs(ilp, start, time_limit_s, gap)
    return _solve_pulp(ilp, start, pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=gap, warmStart=True))
