"""Variable elimination (the unconstrained strategy problem) against brute force."""

from __future__ import annotations

import random

import pytest

from planner.intra.elimination import min_sum
from planner.intra.ilp import brute_force, solve_unconstrained
from planner.intra.ilp_matrix import reduce_problem
from planner.intra.problem import StrategyEdge, StrategyProblem


def random_problem(seed: int) -> StrategyProblem:
    rng = random.Random(seed)
    count = rng.randint(1, 7)
    sizes = [rng.randint(1, 4) for _ in range(count)]
    edges = []
    for _ in range(rng.randint(0, 10) if count > 1 else 0):
        u, v = rng.sample(range(count), 2)
        cost = tuple(tuple(rng.random() for _ in range(sizes[v])) for _ in range(sizes[u]))
        edges.append(StrategyEdge(source=u, target=v, cost=cost, weight=rng.choice([1.0, 2.0])))
    return StrategyProblem(
        names=tuple(str(v) for v in range(count)),
        node_costs=tuple(tuple(rng.random() for _ in range(k)) for k in sizes),
        node_memory=tuple(tuple(rng.random() for _ in range(k)) for k in sizes),
        node_weights=tuple(rng.choice([1.0, 3.0]) for _ in sizes),
        edges=tuple(edges),
        memory_budget=None,
    )


@pytest.mark.parametrize("seed", range(120))
def test_elimination_equals_brute_force(seed: int) -> None:
    problem = random_problem(seed)
    assert solve_unconstrained(problem).objective == pytest.approx(brute_force(problem).objective, abs=1e-9)


def test_too_wide_gives_up() -> None:
    problem = random_problem(3)
    assert min_sum(reduce_problem(problem), max_table=0) is None or not reduce_problem(problem).free
