"""The strategy-choice problem the ILP solves, as plain numbers: variables with per-strategy seconds
and bytes, edges with a seconds matrix, a memory budget (see :mod:`planner.intra.ilp` for the math).

:func:`evaluate` prices one assignment exactly; :func:`smallest_memory` is ``M_min``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.errors import AutoplanError


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
