"""Exact minimum of the strategy problem without a memory row, by variable elimination.

Without the memory budget the ILP of :mod:`planner.intra.problem` is a min-sum over a graph: unary
costs ``c_v`` and pairwise tables ``C_uv`` (:class:`planner.intra.ilp_matrix.Reduced`). Eliminating
a variable ``x`` replaces the factors ``f_1..f_r`` that mention it by one factor over their
other variables ``S``::

    g(S) = min_x Σ_k f_k(S ∪ {x})          (argmin kept for the way back)      (_eliminate)

repeated in greedy min-table-size order (:func:`elimination_order`) until none is left; the
assignment is then read back in reverse (:func:`_read_back`). The work is the sum over
eliminations of ``∏_{y ∈ S ∪ {x}} k_y`` — tiny for layer graphs (chains with residual skips,
treewidth 2–3), where HiGHS takes tenths of a second per solve. When one table would exceed
``max_table`` entries, :func:`min_sum` gives up (None) and the caller uses the ILP.

Pareto points of (time, memory) come from :func:`planner.inter.layer_costs.layer_table`, whose Lagrangian
sweep of the memory row calls this (through :func:`planner.intra.ilp.solve_unconstrained`) with
``c_v + λ·m_v`` for several ``λ``.
"""

from __future__ import annotations

import numpy as np

from planner.intra.ilp_matrix import Reduced

MAX_TABLE = 4_000_000

_Factor = tuple[tuple[int, ...], np.ndarray]  # (variables in axis order, table)


def min_sum(reduced: Reduced, *, max_table: int = MAX_TABLE) -> tuple[int, ...] | None:
    """Per free variable, the strategy of least total cost; None when elimination would be too wide."""
    sizes = [len(costs) for costs in reduced.node_costs]
    order = elimination_order(sizes, [(u, v) for u, v, _ in reduced.edges], max_table=max_table)
    if order is None:
        return None
    factors: list[_Factor] = [((v,), np.asarray(costs, dtype=float)) for v, costs in enumerate(reduced.node_costs)]
    factors += [((u, v), np.asarray(matrix, dtype=float)) for u, v, matrix in reduced.edges]
    trail = []
    for x in order:
        factors, record = _eliminate(factors, x, sizes)
        trail.append(record)
    return _read_back(trail, len(sizes))


def _scope(factors: list[_Factor], x: int) -> tuple[int, ...]:
    return tuple(sorted({y for variables, _ in factors if x in variables for y in variables}))


def elimination_order(sizes: list[int], edges: list[tuple[int, int]], *, max_table: int) -> list[int] | None:
    """Greedy min-table-size order (the smallest table ``∏ k_y`` first) on the interaction graph alone: a factor
    mentions ``x`` exactly when it joins ``x`` to a neighbour, and eliminating ``x`` joins its neighbours
    (fill-in), so the scopes follow from adjacency sets without scanning the factors. Ties go to the first
    variable in the iteration order of the same ``remaining`` set, as before. None if a table is too wide."""
    neighbours: list[set[int]] = [set() for _ in sizes]
    for u, v in edges:
        neighbours[u].add(v)
        neighbours[v].add(u)
    remaining, order = set(range(len(sizes))), []
    while remaining:
        best, best_size = None, None
        for x in remaining:
            size = sizes[x]
            for y in neighbours[x]:
                size *= sizes[y]
            if best_size is None or size < best_size:
                best, best_size = x, size
        assert best is not None and best_size is not None
        if best_size > max_table:
            return None
        joined = neighbours[best]
        for y in joined:
            neighbours[y].discard(best)
            neighbours[y].update(z for z in joined if z != y)
        order.append(best)
        remaining.discard(best)
    return order


def _aligned(variables: tuple[int, ...], table: np.ndarray, scope: tuple[int, ...]) -> np.ndarray:
    """``table`` with its axes in ``scope``'s order and size-1 axes for the variables it lacks."""
    order = sorted(range(len(variables)), key=lambda axis: scope.index(variables[axis]))
    moved = np.transpose(table, order)
    shape = [table.shape[variables.index(y)] if y in variables else 1 for y in scope]
    return moved.reshape(shape)


def _eliminate(factors: list[_Factor], x: int, sizes: list[int]) -> tuple[list[_Factor], tuple]:
    scope = _scope(factors, x)
    touching = [(variables, table) for variables, table in factors if x in variables]
    rest = [(variables, table) for variables, table in factors if x not in variables]
    total = np.zeros([sizes[y] for y in scope])
    for variables, table in touching:
        total = total + _aligned(variables, table, scope)
    axis = scope.index(x)
    others = tuple(y for y in scope if y != x)
    best = np.argmin(total, axis=axis)
    rest.append((others, np.min(total, axis=axis)))
    return rest, (x, others, best)


def _read_back(trail: list[tuple], count: int) -> tuple[int, ...]:
    choice = [0] * count
    for x, others, best in reversed(trail):
        choice[x] = int(best[tuple(choice[y] for y in others)]) if others else int(best)
    return tuple(choice)
