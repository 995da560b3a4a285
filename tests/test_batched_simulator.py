"""The batched placement simulator gives the simulator's step time and peak memory, bit for bit."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.baselines.placement.batched_simulator import simulate_placements
from planner.baselines.placement.dataflow import simulate_assignment
from planner.baselines.placement.exact_sum import fsum_prefix
from planner.baselines.placement.problem import PlacementProblem

SECONDS = st.sampled_from([0.0, 0.005, 0.01, 0.02, 1 / 3])  # repeated values: ties, as identical layers give
BYTES = st.sampled_from([0.0, 1e6, 3e6, 2.5e7])


@st.composite
def problems(draw: st.DrawFn) -> PlacementProblem:
    n = draw(st.integers(1, 24))
    d = draw(st.integers(1, 4))
    edges: dict[tuple[int, int], float] = {}
    for v in range(1, n):
        for u in draw(st.sets(st.integers(0, v - 1), min_size=1, max_size=min(v, 3))):
            edges[u, v] = draw(BYTES)
    links = st.lists(st.lists(st.sampled_from([1e-3, 2e-3, 0.0]), min_size=d, max_size=d), min_size=d, max_size=d)
    bandwidth = st.lists(
        st.lists(st.sampled_from([1e9, 2.5e9, np.inf]), min_size=d, max_size=d), min_size=d, max_size=d
    )
    return PlacementProblem(
        names=tuple(f"op{i}" for i in range(n)),
        fwd_s=tuple(draw(st.lists(SECONDS, min_size=n, max_size=n))),
        bwd_s=tuple(draw(st.lists(SECONDS, min_size=n, max_size=n))),
        step_s=tuple(draw(st.lists(st.sampled_from([0.0, 1e-3, 0.1]), min_size=n, max_size=n))),
        state_bytes=tuple(draw(st.lists(BYTES, min_size=n, max_size=n))),
        activation_bytes=tuple(draw(st.lists(BYTES, min_size=n, max_size=n))),
        edges=tuple((u, v, b) for (u, v), b in sorted(edges.items())),
        device_speed=tuple(draw(st.lists(st.sampled_from([1.0, 2.0, 0.7]), min_size=d, max_size=d))),
        device_memory_bytes=(1e12,) * d,
        num_microbatches=draw(st.integers(1, 4)),
        link_latency_s=tuple(map(tuple, draw(links))),
        link_bandwidth=tuple(map(tuple, draw(bandwidth))),
        step_overhead_s=draw(st.sampled_from([0.0, 0.003])),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=problems(), seed=st.integers(0, 2**32 - 1))
def test_random_placements_of_random_problems_match_the_simulator(problem: PlacementProblem, seed: int) -> None:
    rows = np.random.default_rng(seed).integers(0, problem.num_devices, size=(6, problem.num_ops))
    rows[0] = 0  # everything on one device
    result = simulate_placements(problem, rows)
    for row, step_s, peak in zip(rows, result.step_time_s, result.peak_memory_bytes, strict=True):
        expected = simulate_assignment(problem, tuple(int(d) for d in row))
        assert step_s == expected.step_time_s
        assert tuple(peak) == expected.peak_memory_bytes


def test_gpt_placements_match_the_simulator(gpt_placement_problem: PlacementProblem) -> None:
    """Random scatters, contiguous pipelines and round-robin ones of a 256-group GPT problem."""
    problem = gpt_placement_problem
    rng = np.random.default_rng(0)
    n, d = problem.num_ops, problem.num_devices
    position = np.arange(n) * d // n
    rows = np.stack([*rng.integers(0, d, size=(8, n)), position, (2 * position) % d, (position + 3) % d])
    result = simulate_placements(problem, rows)
    for row, step_s, peak in zip(rows, result.step_time_s, result.peak_memory_bytes, strict=True):
        expected = simulate_assignment(problem, tuple(int(x) for x in row))
        assert step_s == expected.step_time_s
        assert tuple(peak) == expected.peak_memory_bytes


def test_an_empty_batch_and_the_batch_split_over_threads_agree() -> None:
    problem = PlacementProblem(
        names=("a", "b", "c"),
        fwd_s=(1.0, 2.0, 1.0),
        bwd_s=(2.0, 4.0, 2.0),
        step_s=(0.1, 0.1, 0.1),
        state_bytes=(1.0, 1.0, 1.0),
        activation_bytes=(2.0, 2.0, 2.0),
        edges=((0, 1, 1e6), (1, 2, 1e6)),
        device_speed=(1.0, 1.0),
        device_memory_bytes=(1e9, 1e9),
        num_microbatches=2,
        link_latency_s=((0.0, 0.5), (0.5, 0.0)),
        link_bandwidth=((np.inf, 1e9), (1e9, np.inf)),
    )
    assert simulate_placements(problem, np.zeros((0, 3), dtype=np.int64)).step_time_s.shape == (0,)
    rows = np.array([[a, b, c] for a in range(2) for b in range(2) for c in range(2)] * 8)  # 64 rows: threads
    batch = simulate_placements(problem, rows).step_time_s
    assert [simulate_placements(problem, row[None]).step_time_s[0] for row in rows] == batch.tolist()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.floats(min_value=-1e12, max_value=1e12, allow_nan=False) | st.sampled_from([1e16, -1e16, 0.1, 1e-3]),
        max_size=40,
    )
)
def test_the_compiled_fsum_is_math_fsum(values: list[float]) -> None:
    array = np.array([*values, 123.0])  # a value past ``count``, which must not be summed
    assert fsum_prefix(array, len(values), np.empty(len(values) + 1)) == math.fsum(values)
