"""The classic device-placement baselines: hash, critical path, multi-objective, m-ETF."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.baselines.placement.critical_path import critical_path, critical_path_placement, mean_transfer, upward_rank
from planner.baselines.placement.hash_placement import hash_placement
from planner.baselines.placement.m_etf import m_etf_placement
from planner.baselines.placement.multi_objective import multi_objective_placement
from planner.baselines.placement.problem import (
    PlacementProblem,
    check_assignment,
    device_memory_used,
    fits,
    uniform_links,
)
from planner.errors import AutoplanError

Placement = Callable[[PlacementProblem], tuple[int, ...]]
BASELINES: list[Placement] = [hash_placement, critical_path_placement, multi_objective_placement, m_etf_placement]
GB = 1e9


def problem(
    times: Sequence[float],
    edges: Sequence[tuple[int, int, float]] = (),
    *,
    speeds: Sequence[float] = (1.0, 1.0),
    memory: Sequence[float] | None = None,
    capacity: Sequence[float] | None = None,
) -> PlacementProblem:
    """Ops of ``times`` seconds (all forward), ``memory`` bytes of state each (default 1 GB)."""
    n = len(times)
    memory = [GB] * n if memory is None else memory
    return PlacementProblem(
        names=tuple(f"op{i}" for i in range(n)),
        fwd_s=tuple(times),
        bwd_s=(0.0,) * n,
        step_s=(0.0,) * n,
        state_bytes=tuple(memory),
        activation_bytes=(0.0,) * n,
        edges=tuple(edges),
        device_speed=tuple(speeds),
        device_memory_bytes=tuple(capacity) if capacity is not None else (1e3 * GB,) * len(speeds),
        num_microbatches=2,
        **uniform_links(len(speeds), latency_s=1e-3, bandwidth=1e9),  # 1 ms + 1 GB/s between devices
    )


def chain_with_branches(length: int) -> tuple[PlacementProblem, list[int]]:
    """A chain of 1 s ops, each with a 0.1 s side branch (a sink), on devices of speed (1, 2, 1)."""
    times, edges, chain = [], [], []
    for k in range(length):
        chain.append(len(times))
        times += [1.0, 0.1]
        edges.append((chain[-1], chain[-1] + 1, 1e6))
        if k:
            edges.append((chain[-2], chain[-1], 1e6))
    return problem(times, edges, speeds=(1.0, 2.0, 1.0)), chain


def assert_valid(p: PlacementProblem, assignment: tuple[int, ...]) -> None:
    check_assignment(p, assignment)
    assert fits(p, assignment)


# --- hash ---


def test_hash_spreads_ops_evenly() -> None:
    p = problem([1.0] * 10, [(i, i + 1, 1e6) for i in range(9)], speeds=(1.0, 3.0, 1.0))
    counts = Counter(hash_placement(p))
    assert sorted(counts.values()) == [3, 3, 4]
    assert hash_placement(p)[:4] == (0, 1, 2, 0)


def test_hash_respects_memory() -> None:
    p = problem([1.0] * 4, memory=[4 * GB, GB, 4 * GB, GB], capacity=(5 * GB, 5 * GB))
    assignment = hash_placement(p)
    assert assignment == (0, 1, 1, 0)  # op2 does not fit on device 0 any more: device 1, the counter back to 0
    assert all(u <= c for u, c in zip(device_memory_used(p, assignment), p.device_memory_bytes, strict=True))


@pytest.mark.parametrize("placement", BASELINES)
def test_op_too_big_for_every_device(placement: Placement) -> None:
    p = problem([1.0, 1.0, 1.0], [(0, 1, 1e6), (1, 2, 1e6)], memory=[GB, 9 * GB, GB], capacity=(4 * GB, 4 * GB))
    with pytest.raises(AutoplanError, match=r"op op1 needs 8\.38 GiB but no device has that much free") as info:
        placement(p)
    assert "\n" not in str(info.value)
    assert "capacity 3.73 GiB each" in str(info.value)


# --- critical path ---


def test_critical_path_follows_the_longest_chain() -> None:
    p, chain = chain_with_branches(6)
    rank = upward_rank(p)
    path = critical_path(p, rank)
    assert path == [*chain, chain[-1] + 1]  # the chain, then the last op's branch (its only successor)
    transfer = mean_transfer(p)
    length = sum(p.time_s(op) for op in path) / 2.0 + sum(transfer(1e6) for _ in path[1:])
    assert rank[path[0]] == pytest.approx(length)


def test_critical_path_on_the_fastest_device() -> None:
    p, chain = chain_with_branches(6)
    assignment = critical_path_placement(p)
    assert_valid(p, assignment)
    assert all(assignment[op] == 1 for op in chain)
    assert {assignment[op + 1] for op in chain[:-1]} == {0, 2}  # branches balance the slow devices


def test_critical_path_too_big_for_the_fast_device() -> None:
    p, chain = chain_with_branches(6)
    small = problem(
        [p.time_s(op) for op in range(p.num_ops)], p.edges, speeds=p.device_speed, capacity=(6 * GB, 2 * GB, 6 * GB)
    )
    assignment = critical_path_placement(small)  # the path needs 7 GB: no device holds it
    assert_valid(small, assignment)
    assert [assignment[op] for op in chain[:2]] == [1, 1]  # the start of the path, as much as fits
    assert Counter(assignment)[1] == 2


def test_critical_path_takes_a_slower_device_that_holds_the_path() -> None:
    p, chain = chain_with_branches(4)
    small = problem(
        [p.time_s(op) for op in range(p.num_ops)], p.edges, speeds=(1.0, 2.0, 1.5), capacity=(20 * GB, 2 * GB, 20 * GB)
    )
    assignment = critical_path_placement(small)
    assert_valid(small, assignment)
    assert all(assignment[op] == 2 for op in chain)


# --- multi-objective ---


def test_multi_objective_heavy_critical_op_on_the_fast_device() -> None:
    times = [0.1] * 6 + [10.0, 0.1]
    edges = [(i, 6, 1e6) for i in range(6)] + [(6, 7, 1e6)]
    p = problem(times, edges, speeds=(1.0, 4.0, 1.0))
    assignment = multi_objective_placement(p)
    assert_valid(p, assignment)
    assert assignment[6] == 1


def test_multi_objective_spreads_independent_ops() -> None:
    p = problem([1.0] * 8, speeds=(1.0,) * 4)
    assert Counter(multi_objective_placement(p)) == {0: 2, 1: 2, 2: 2, 3: 2}


def test_multi_objective_respects_memory() -> None:
    p = problem([1.0] * 6, [(i, i + 1, 1e6) for i in range(5)], speeds=(1.0, 4.0), capacity=(4 * GB, 2 * GB))
    assignment = multi_objective_placement(p)
    assert_valid(p, assignment)
    assert Counter(assignment) == {0: 4, 1: 2}


# --- m-ETF ---


def test_m_etf_two_chains_on_their_own_devices() -> None:
    edges = [(i, i + 2, 1e9) for i in range(8)]  # chains 0, 2, 4, … and 1, 3, 5, …, 1 s per transfer
    assignment = m_etf_placement(problem([1.0] * 10, edges))
    assert len({assignment[i] for i in range(0, 10, 2)}) == 1
    assert len({assignment[i] for i in range(1, 10, 2)}) == 1
    assert assignment[0] != assignment[1]


def test_m_etf_chain_with_costly_transfers_stays_on_one_device() -> None:
    p = problem([1.0] * 6, [(i, i + 1, 1e12) for i in range(5)], speeds=(1.0,) * 4)
    assert m_etf_placement(p) == (0,) * 6


def test_m_etf_respects_memory() -> None:
    p = problem([1.0] * 6, [(i, i + 1, 1e12) for i in range(5)], speeds=(1.0,) * 3, capacity=(2 * GB,) * 3)
    assignment = m_etf_placement(p)
    assert_valid(p, assignment)
    assert Counter(assignment) == {0: 2, 1: 2, 2: 2}


def naive_m_etf(p: PlacementProblem) -> tuple[int, ...]:
    """m-ETF by scanning every ready (op, device) pair at every step."""
    rank = upward_rank(p)
    predecessors = p.predecessors()
    device: list[int] = [-1] * p.num_ops
    finish = [0.0] * p.num_ops
    free_at = [0.0] * p.num_devices
    used = [0.0] * p.num_devices
    for _ in range(p.num_ops):
        pairs = []
        for op in range(p.num_ops):
            if device[op] >= 0 or any(device[u] < 0 for u, _ in predecessors[op]):
                continue
            for d in range(p.num_devices):
                if used[d] + p.memory_bytes(op) <= p.device_memory_bytes[d]:
                    arrival = max(
                        (
                            finish[u] + (p.transfer_s(device[u], d, b) if device[u] != d else 0.0)
                            for u, b in predecessors[op]
                        ),
                        default=0.0,
                    )
                    pairs.append((max(free_at[d], arrival), -rank[op], op, d))
        start, _, op, d = min(pairs)
        device[op], finish[op] = d, start + p.time_s(op) / p.device_speed[d]
        free_at[d] = finish[op]
        used[d] += p.memory_bytes(op)
    return tuple(device)


# --- every baseline on random DAGs ---


@st.composite
def random_problems(draw: st.DrawFn) -> PlacementProblem:
    """A random DAG with a memory that every greedy placement can meet (some device always has room)."""
    n = draw(st.integers(1, 10))
    pairs = [(u, v) for v in range(n) for u in range(v)]
    chosen = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=15)) if pairs else []
    edges = [(u, v, draw(st.sampled_from([0.0, 1e6, 1e9]))) for u, v in sorted(chosen)]
    times = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]), min_size=n, max_size=n))
    memory = draw(st.lists(st.sampled_from([0.0, 1.0, 2.0, 5.0]), min_size=n, max_size=n))
    speeds = draw(st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=1, max_size=4))
    # sum(capacity) ≥ total + D·max: whatever is placed, some device has room for the largest op.
    base = sum(memory) / len(speeds) + max(memory)
    capacity = [base * draw(st.sampled_from([1.0, 1.5, 3.0])) for _ in speeds]
    return problem(times, edges, speeds=speeds, memory=[m * GB for m in memory], capacity=[c * GB for c in capacity])


@settings(max_examples=80, deadline=None)
@given(random_problems())
def test_every_baseline_is_valid_on_random_dags(p: PlacementProblem) -> None:
    for placement in BASELINES:
        assert_valid(p, placement(p))


@settings(max_examples=80, deadline=None)
@given(random_problems())
def test_m_etf_equals_the_naive_scan(p: PlacementProblem) -> None:
    assert m_etf_placement(p) == naive_m_etf(p)


@settings(max_examples=50, deadline=None)
@given(random_problems())
def test_critical_path_length_is_the_source_rank(p: PlacementProblem) -> None:
    rank = upward_rank(p)
    path = critical_path(p, rank)
    transfer = mean_transfer(p)
    weights = {(u, v): b for u, v, b in p.edges}
    length = sum(p.time_s(op) for op in path) / max(p.device_speed)
    length += sum(transfer(weights[edge]) for edge in itertools.pairwise(path))
    assert rank[path[0]] == pytest.approx(length)
    assert rank[path[0]] == pytest.approx(max(rank))


class _RotaryByCopy(torch.nn.Module):
    """Assembles its output by ``copy_`` into slices of an empty tensor, as Hugging Face DeepSeek-V3's rotary
    embedding does: the update reaches the base tensor only through aliasing."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        out = h.new_empty(h.shape)
        out[..., :4].copy_(h[..., 4:])
        out[..., 4:].copy_(h[..., :4])
        return out.sum(-1)


def test_a_placement_refuses_a_model_that_updates_a_view_in_place() -> None:
    """Each operator on its own device, an in-place update runs on a copy: writing into a view would not reach the
    base tensor's readers, so the plan is refused at planning time with the reason (it ran on uninitialised values)."""
    from cost_models.cluster import load_cluster
    from planner.api import plan as plan_model
    from planner.baselines.placement.aliasing import aliasing_refusal

    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    inputs = (torch.randn(4, 8),)
    with pytest.raises(AutoplanError, match=r"updates a view \(slice\w*\) of another tensor in place \(copy_"):
        plan_model(_RotaryByCopy(), inputs, cluster, batch_size=4, method="hash")
    assert plan_model(_RotaryByCopy(), inputs, cluster, batch_size=4, method="data-parallel") is not None
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    from planner.ir.capture import capture

    assert aliasing_refusal(capture(plain, inputs), method="hash") is None
