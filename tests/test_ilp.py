"""The strategy ILP against exhaustive enumeration, on random small problems."""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest

import planner.intra.ilp as ilp
from cost_models.units import GIB
from planner.errors import AutoplanError
from planner.intra import ilp_matrix
from planner.intra.ilp import brute_force, solve_strategy_ilp
from planner.intra.problem import MemoryBudgetError, StrategyEdge, StrategyProblem, evaluate


def random_problem(rng: random.Random, *, max_variables: int = 8, max_assignments: int = 4096) -> StrategyProblem:
    """Up to 8 variables of 1-4 strategies; weights, duplicate and reversed edges, budgets that may not fit."""
    count = rng.randint(1, max_variables)
    sizes = [rng.choice([1, 2, 2, 3, 3, 4]) for _ in range(count)]
    while np.prod(sizes) > max_assignments:
        sizes[rng.randrange(count)] = 1
    weights = [rng.choice([1.0, 1.0, 0.5, 2.0, 3.0]) for _ in range(count)]
    edges = []
    for _ in range(rng.randint(0, 12) if count > 1 else 0):
        source, target = rng.sample(range(count), 2)
        cost = tuple(tuple(round(rng.uniform(0, 5), 3) for _ in range(sizes[target])) for _ in range(sizes[source]))
        edges.append(StrategyEdge(source=source, target=target, cost=cost, weight=rng.choice([1.0, 1.0, 2.0, 0.25])))
        if rng.random() < 0.3:  # the same pair again, one way or the other
            source, target = rng.choice([(source, target), (target, source)])
            cost = tuple(tuple(rng.uniform(0, 5) for _ in range(sizes[target])) for _ in range(sizes[source]))
            edges.append(StrategyEdge(source=source, target=target, cost=cost))
    memory = tuple(tuple(rng.uniform(1, 100) * GIB for _ in range(size)) for size in sizes)
    low = sum(w * min(m) for w, m in zip(weights, memory, strict=True))
    high = sum(w * max(m) for w, m in zip(weights, memory, strict=True))
    return StrategyProblem(
        names=tuple(f"op{v}" for v in range(count)),
        node_costs=tuple(tuple(rng.uniform(0, 10) for _ in range(size)) for size in sizes),
        node_memory=memory,
        node_weights=tuple(weights),
        edges=tuple(edges),
        memory_budget=None if rng.random() < 0.15 else rng.uniform(0.85 * low, 1.05 * high),
    )


def enumerate_all(problem: StrategyProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every assignment with its objective and memory, vectorised, independent of the module's own code."""
    choices = np.array(list(itertools.product(*(range(len(c)) for c in problem.node_costs))), dtype=int)
    objective, memory = np.zeros(len(choices)), np.zeros(len(choices))
    for v, weight in enumerate(problem.node_weights):
        objective += weight * np.asarray(problem.node_costs[v])[choices[:, v]]
        memory += weight * np.asarray(problem.node_memory[v])[choices[:, v]]
    for edge in problem.edges:
        objective += edge.weight * np.asarray(edge.cost)[choices[:, edge.source], choices[:, edge.target]]
    return choices, objective, memory


@pytest.mark.parametrize("seed", range(80))
def test_ilp_matches_brute_force(seed: int) -> None:
    problem = random_problem(random.Random(seed))
    choices, objective, memory = enumerate_all(problem)
    fits = np.ones(len(choices), bool) if problem.memory_budget is None else memory <= problem.memory_budget
    reference = brute_force(problem)
    if not fits.any():
        assert reference is None
        with pytest.raises(MemoryBudgetError) as error:
            solve_strategy_ilp(problem)
        assert error.value.smallest_bytes == pytest.approx(memory.min(), rel=1e-12)
        return
    assert reference is not None
    assert reference.objective == pytest.approx(objective[fits].min(), rel=1e-9, abs=1e-9)
    solution = solve_strategy_ilp(problem)
    assert solution.optimal
    assert solution.objective == pytest.approx(reference.objective, rel=1e-6, abs=1e-6)
    assert (solution.objective, solution.memory_bytes) == evaluate(problem, solution.choice)
    assert problem.memory_budget is None or solution.memory_bytes <= problem.memory_budget


def test_problems_cover_infeasible_weighted_and_merged_edges() -> None:
    problems = [random_problem(random.Random(seed)) for seed in range(80)]
    assert sum(brute_force(p) is None for p in problems) >= 5
    assert sum(any(w != 1.0 for w in p.node_weights) for p in problems) >= 40
    pairs = [[frozenset((e.source, e.target)) for e in p.edges] for p in problems]
    assert sum(len(set(pair)) < len(pair) for pair in pairs) >= 20


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_pulp_solvers_match_brute_force(solver: str) -> None:
    for seed in range(3):
        problem = random_problem(random.Random(1000 + seed))
        reference = brute_force(problem)
        if reference is not None:
            solution = solve_strategy_ilp(problem, solver=solver)
            assert solution.objective == pytest.approx(reference.objective, rel=1e-6, abs=1e-6)


def two_variables(edges: tuple[StrategyEdge, ...], budget: float | None = None) -> StrategyProblem:
    return StrategyProblem(
        names=("a", "b"),
        node_costs=((1.0, 2.0), (3.0, 1.0, 2.0)),
        node_memory=((4.0, 1.0), (1.0, 2.0, 3.0)),
        node_weights=(1.0, 2.0),
        edges=edges,
        memory_budget=budget,
    )


def test_duplicate_and_reversed_edges_are_merged_into_one_edge() -> None:
    forward = ((0.0, 9.0, 1.0), (5.0, 0.0, 7.0))
    backward = ((0.0, 4.0), (6.0, 0.0), (1.0, 8.0))
    edges = (
        StrategyEdge(source=0, target=1, cost=forward, weight=2.0),
        StrategyEdge(source=1, target=0, cost=backward),
        StrategyEdge(source=0, target=1, cost=forward, weight=0.5),
    )
    problem = two_variables(edges)
    solution = solve_strategy_ilp(problem)
    assert solution.num_variables == 2 + 3 + 2 * 3  # s of both, one merged e
    assert solution.num_constraints == 2 + 2 + 3
    assert solution.objective == brute_force(problem).objective
    assert evaluate(problem, (0, 1)) == (1.0 + 2 * 1.0 + 2.5 * 9.0 + 6.0, 4.0 + 2 * 2.0)


def test_separable_edges_fold_into_node_costs() -> None:
    separable = ((1.0, 2.0, 3.0), (11.0, 12.0, 13.0))  # 1 + 10·i + j
    problem = two_variables((StrategyEdge(source=0, target=1, cost=separable),), budget=7.0)
    solution = solve_strategy_ilp(problem)
    assert solution.num_variables == 5
    assert solution.choice == brute_force(problem).choice


def test_single_strategy_variables_are_constants() -> None:
    problem = StrategyProblem(
        names=("fixed", "free", "also_fixed"),
        node_costs=((5.0,), (1.0, 3.0), (2.0,)),
        node_memory=((1.0,), (2.0, 1.0), (1.0,)),
        node_weights=(1.0, 1.0, 1.0),
        edges=(
            StrategyEdge(source=0, target=1, cost=((4.0, 0.0),)),
            StrategyEdge(source=2, target=0, cost=((1.0,),), weight=3.0),
        ),
        memory_budget=10.0,
    )
    solution = solve_strategy_ilp(problem)
    assert solution.choice == (0, 1, 0) == brute_force(problem).choice
    assert solution.objective == 5.0 + 3.0 + 2.0 + 3.0
    assert solution.num_variables == 2
    constant = StrategyProblem(
        names=("x", "y"),
        node_costs=((1.0,), (2.0,)),
        node_memory=((1.0,), (1.0,)),
        node_weights=(1.0, 1.0),
        edges=(StrategyEdge(source=0, target=1, cost=((4.0,),)),),
        memory_budget=None,
    )
    trivial = solve_strategy_ilp(constant)
    assert (trivial.choice, trivial.objective, trivial.num_variables, trivial.optimal) == ((0, 0), 7.0, 0, True)


def test_memory_error_names_the_budget_the_smallest_and_the_largest_variable() -> None:
    problem = StrategyProblem(
        names=("embedding", "head"),
        node_costs=((1.0, 2.0), (1.0, 1.0)),
        node_memory=((2 * GIB, 4 * GIB), (0.5 * GIB, 1 * GIB)),
        node_weights=(1.0, 2.0),
        edges=(),
        memory_budget=2.5 * GIB,
    )
    with pytest.raises(AutoplanError) as error:
        solve_strategy_ilp(problem)
    message = str(error.value)
    assert message == (
        "no sharding fits in 2.5 GiB per device: the smallest needs 3 GiB (variable with most memory: embedding)"
    )
    assert "\n" not in message
    close = dataclasses.replace(problem, memory_budget=3 * GIB - 1024)
    with pytest.raises(MemoryBudgetError, match=r"fits in 2\.999999 GiB .* needs 3 GiB"):
        solve_strategy_ilp(close)


def test_budget_binds() -> None:
    problem = two_variables((), budget=3.0)
    assert solve_strategy_ilp(problem).choice == (1, 0) == brute_force(problem).choice
    assert solve_strategy_ilp(two_variables((), budget=None)).choice == (0, 1)


def test_an_incumbent_beats_a_worse_time_limited_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    problem = random_problem(random.Random(7))
    reference = brute_force(problem)
    assignments = itertools.product(*(range(len(costs)) for costs in problem.node_costs))
    fitting = [choice for choice in assignments if ilp._fits(problem, evaluate(problem, choice)[1])]
    worst = max(fitting, key=lambda choice: evaluate(problem, choice)[0])
    assert evaluate(problem, worst)[0] > reference.objective

    def time_limited(matrix: ilp_matrix.MatrixIlp, start: np.ndarray, time_limit_s: float, gap: float) -> tuple:
        reduced = ilp_matrix.reduce_problem(problem)
        return ilp_matrix.start_vector(reduced, matrix, worst), False, "Time limit reached"

    monkeypatch.setattr(ilp_matrix, "_solve_highs", time_limited)
    solution = solve_strategy_ilp(problem, incumbents=[reference.choice])
    assert solution.choice == reference.choice
    assert not solution.optimal
    assert solution.status == "Time limit reached; kept the MIP start"


def test_a_real_time_limit_never_returns_worse_than_the_incumbent() -> None:
    rng = random.Random(3)
    count, size = 150, 6
    edges = tuple(
        StrategyEdge(source=u, target=v, cost=tuple(tuple(rng.random() for _ in range(size)) for _ in range(size)))
        for u, v in (rng.sample(range(count), 2) for _ in range(300))
    )
    problem = StrategyProblem(
        names=tuple(map(str, range(count))),
        node_costs=tuple(tuple(rng.random() for _ in range(size)) for _ in range(count)),
        node_memory=tuple(tuple(rng.random() for _ in range(size)) for _ in range(count)),
        node_weights=(1.0,) * count,
        edges=edges,
        memory_budget=None,
    )
    incumbent = solve_strategy_ilp(problem, time_limit_s=0.5)
    hurried = solve_strategy_ilp(problem, time_limit_s=0.01, incumbents=[(0,) * count, incumbent.choice])
    assert hurried.objective <= incumbent.objective
    assert not hurried.optimal


def test_invalid_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="cost is not 2x3"):
        two_variables((StrategyEdge(source=0, target=1, cost=((1.0, 2.0), (3.0, 4.0))),))
    with pytest.raises(ValueError, match="joins no two distinct"):
        two_variables((StrategyEdge(source=1, target=1, cost=((1.0,) * 3,) * 3),))
    with pytest.raises(ValueError, match="does not pick"):
        evaluate(two_variables(()), (0, 3))
    with pytest.raises(ValueError, match="need solver in"):
        solve_strategy_ilp(two_variables(()), solver="gurobi")
