"""The inter-operator stage DP against exhaustive enumeration, hand-worked pipelines, and device packing."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from planner.errors import AutoplanError
from planner.inter.stage_dp.device_blocks import Submesh, assign_devices
from planner.inter.stage_dp.solver import StageOption, StagePlan, solve_stages, submeshes

CLUSTERS = [(1, 8), (2, 4), (1, 4), (2, 2), (3, 2), (1, 6), (1, 1), (2, 1)]


class TableCosts:
    """Options from a dict keyed by (first, last, submesh); counts the queries."""

    def __init__(self, table: dict[tuple[int, int, Submesh], list[StageOption]]) -> None:
        self.table, self.calls = table, Counter()

    def options(self, first: int, last: int, submesh: Submesh) -> list[StageOption]:
        self.calls[first, last, submesh] += 1
        return self.table.get((first, last, submesh), [])


class UniformCosts:
    """Every layer alike: ``time = layers·seconds/size`` (× ``cross_node`` across nodes), state not sharded."""

    def __init__(self, *, state: float, activation: float, cross_node: float = 1.0) -> None:
        self.state, self.activation, self.cross_node = state, activation, cross_node

    def options(self, first: int, last: int, submesh: Submesh) -> list[StageOption]:
        layers = last - first + 1
        factor = self.cross_node if submesh.num_nodes > 1 else 1.0
        time_s = layers / submesh.size * factor
        return [
            StageOption(
                time_s=time_s, state_bytes=layers * self.state, activation_bytes=layers * self.activation / submesh.size
            )
        ]


def random_case(rng: random.Random, *, max_layers: int = 6, clusters: list[tuple[int, int]] = CLUSTERS) -> dict:
    """Up to 6 layers and 8 devices, 0-3 options per span and submesh, tight budgets, maybe boundaries."""
    num_nodes, per_node = rng.choice(clusters)
    num_layers, scaling = rng.randint(1, max_layers), rng.choice([0.3, 0.6, 0.9])  # time ∝ size^-scaling
    table = {}
    for first, last, mesh in itertools.product(range(num_layers), range(num_layers), submeshes(num_nodes, per_node)):
        layers = last - first + 1
        count = rng.choice([0, 1, 2, 2, 3]) if last >= first else 0
        table[first, last, mesh] = [
            StageOption(
                time_s=round(rng.uniform(0.1, 1.0) * layers / mesh.size**scaling, 2),
                state_bytes=round(rng.uniform(0, 3) * layers / rng.choice([1, mesh.size]), 1),
                activation_bytes=round(rng.uniform(0, 2) * layers / mesh.size, 1),
                label=o,
            )
            for o in range(count)
        ]
    boundary = None
    if rng.random() < 0.5:
        meshes = submeshes(num_nodes, per_node)
        links = {key: round(rng.uniform(0, 0.3), 2) for key in itertools.product(range(num_layers), meshes, meshes)}
        boundary = lambda i, a, b: links[i, a, b]  # noqa: E731
    return {
        "num_layers": num_layers,
        "num_nodes": num_nodes,
        "devices_per_node": per_node,
        "num_microbatches": rng.choice([1, 2, 4, 8, 8]),
        "costs": TableCosts(table),
        "memory_budget_bytes": rng.choice([3.0, 4.0, 6.0, 8.0, 12.0]),
        "max_stages": rng.choice([None, None, None, 2, 3]),
        "boundary_s": boundary,
    }


def brute_force(case: dict) -> float | None:
    """The least latency over every split, submesh tuple summing to D and option choice; None if none fits."""
    num_layers, num_devices = case["num_layers"], case["num_nodes"] * case["devices_per_node"]
    batches, budget, boundary = case["num_microbatches"], case["memory_budget_bytes"], case["boundary_s"]
    meshes, limit = submeshes(case["num_nodes"], case["devices_per_node"]), case["max_stages"] or num_layers
    best = None
    for cuts in itertools.product([False, True], repeat=num_layers - 1):
        bounds = [0, *(i + 1 for i, cut in enumerate(cuts) if cut), num_layers]
        spans = [(bounds[s], bounds[s + 1] - 1) for s in range(len(bounds) - 1)]
        count = len(spans)
        if count > limit:
            continue
        for placed in itertools.product(meshes, repeat=count):
            if sum(mesh.size for mesh in placed) != num_devices:
                continue
            per_stage = []
            for s, ((first, last), mesh) in enumerate(zip(spans, placed, strict=True)):
                link = boundary(last, mesh, placed[s + 1]) if boundary and s < count - 1 else 0.0
                options = case["costs"].table.get((first, last, mesh), [])
                in_flight = min(count - s, batches)
                fits = [o for o in options if o.state_bytes + o.activation_bytes * in_flight <= budget]
                per_stage.append([o.time_s + link for o in fits])
            for times in itertools.product(*per_stage):
                latency = sum(times) + (batches - 1) * max(times)
                best = latency if best is None else min(best, latency)
    return best


def solve(case: dict, **extra: object) -> StagePlan | None:
    try:
        return solve_stages(**case, **extra)
    except AutoplanError as error:
        assert str(error).startswith("no pipeline of at most")
        return None


def check_plan(case: dict, plan: StagePlan) -> None:
    """Contiguous stages covering every layer, sizes summing to D, memory fitting, latency recomputed."""
    stages, batches = plan.stages, case["num_microbatches"]
    assert stages[0].first == 0 and stages[-1].last == case["num_layers"] - 1
    assert all(a.last + 1 == b.first for a, b in itertools.pairwise(stages))
    assert sum(stage.submesh.size for stage in stages) == case["num_nodes"] * case["devices_per_node"]
    assert case["max_stages"] is None or len(stages) <= case["max_stages"]
    for s, stage in enumerate(stages):
        assert stage.option in case["costs"].table[stage.first, stage.last, stage.submesh]
        in_flight = min(len(stages) - s, batches)
        assert stage.option.state_bytes + stage.option.activation_bytes * in_flight <= case["memory_budget_bytes"]
    times = [stage.time_s for stage in stages]
    assert plan.step_time_s == pytest.approx(sum(times) + (batches - 1) * max(times))
    assert plan.bubble_fraction == pytest.approx(1 - batches * sum(times) / (len(stages) * plan.step_time_s))


def check_against_brute_force(case: dict) -> None:
    plan, expected = solve(case), brute_force(case)
    if expected is None:
        assert plan is None
        return
    assert plan is not None
    check_plan(case, plan)
    assert plan.step_time_s == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("seed", range(60))
def test_dp_matches_brute_force(seed: int) -> None:
    check_against_brute_force(random_case(random.Random(seed)))


@pytest.mark.parametrize("seed", range(20))
def test_early_stop_never_changes_the_answer(seed: int) -> None:
    case = random_case(random.Random(1000 + seed), max_layers=10, clusters=[(2, 8), (4, 4), (1, 16), (3, 4)])
    fast, full = solve(case), solve(case, early_stop=False)
    assert (fast is None) == (full is None)
    if fast is not None:
        assert fast.step_time_s == pytest.approx(full.step_time_s, rel=1e-12)
        assert fast.num_candidates_tried <= full.num_candidates_tried + 1


def test_each_span_and_submesh_is_queried_once() -> None:
    case = random_case(random.Random(7))
    solve(case)
    meshes = submeshes(case["num_nodes"], case["devices_per_node"])
    expected = {(k, i, m) for k in range(case["num_layers"]) for i in range(k, case["num_layers"]) for m in meshes}
    assert set(case["costs"].calls) == expected and set(case["costs"].calls.values()) == {1}


@pytest.mark.parametrize(("budget", "num_stages", "latency"), [(50.0, 1, 4.0), (30.0, 2, 5.0), (20.0, 4, 7.0)])
def test_memory_forces_more_stages(budget: float, num_stages: int, latency: float) -> None:
    # 4 layers on 4 devices, time = layers/size, state 10 per layer (replicated), activation 1 per layer/size.
    # 1 stage needs 40 + 1, 2 stages 20 + 2·1 on the first, 3 stages at least 21, 4 stages 10 + 4 on the first.
    plan = solve_stages(
        num_layers=4,
        num_nodes=1,
        devices_per_node=4,
        num_microbatches=4,
        costs=UniformCosts(state=10.0, activation=1.0),
        memory_budget_bytes=budget,
    )
    assert len(plan.stages) == num_stages and plan.step_time_s == pytest.approx(latency)
    assert all(stage.last - stage.first + 1 == stage.submesh.size == 4 // num_stages for stage in plan.stages)


def test_nothing_fits_names_the_budget() -> None:
    with pytest.raises(AutoplanError, match=r"no pipeline of at most 4 stages fits in 9\.31e-09 GiB per device"):
        solve_stages(
            num_layers=4,
            num_nodes=1,
            devices_per_node=4,
            num_microbatches=4,
            costs=UniformCosts(state=10.0, activation=1.0),
            memory_budget_bytes=10.0,
        )


@pytest.mark.parametrize(("link_s", "num_stages", "latency"), [(None, 2, 65.0), (0.6, 1, 96.0)])
def test_boundary_costs_favour_one_stage(link_s: float | None, num_stages: int, latency: float) -> None:
    # 2 nodes of 2 devices: data parallel across nodes costs 1.5×, so 2 stages of one node each win (2 + 63 < 96)
    # until each boundary costs 0.6 s: 2.6 + 63·1.6 = 103.4 > 96.
    plan = solve_stages(
        num_layers=4,
        num_nodes=2,
        devices_per_node=2,
        num_microbatches=64,
        costs=UniformCosts(state=0.0, activation=0.0, cross_node=1.5),
        memory_budget_bytes=1.0,
        boundary_s=None if link_s is None else lambda i, a, b: link_s,
    )
    assert len(plan.stages) == num_stages and plan.step_time_s == pytest.approx(latency)


def test_max_stages_limits_the_pipeline() -> None:
    costs = UniformCosts(state=10.0, activation=1.0)
    kwargs = {"num_layers": 4, "num_nodes": 1, "devices_per_node": 4, "num_microbatches": 4, "costs": costs}
    with pytest.raises(AutoplanError, match="at most 2 stages"):
        solve_stages(**kwargs, memory_budget_bytes=20.0, max_stages=2)
    assert len(solve_stages(**kwargs, memory_budget_bytes=30.0, max_stages=2).stages) == 2


def test_submeshes_are_alpas_shapes() -> None:
    assert [(m.num_nodes, m.devices_per_node) for m in submeshes(3, 8)] == [
        (1, 1),
        (1, 2),
        (1, 4),
        (1, 8),
        (2, 8),
        (3, 8),
    ]
    assert [(m.num_nodes, m.devices_per_node) for m in submeshes(2, 6)] == [(1, 1), (1, 2), (1, 6), (2, 6)]
    assert [(m.num_nodes, m.devices_per_node) for m in submeshes(1, 1)] == [(1, 1)]


def check_ranks(meshes: list[Submesh], ranks: list[tuple[int, ...]], per_node: int, num_devices: int) -> None:
    assert sorted(itertools.chain.from_iterable(ranks)) == list(range(num_devices))
    for mesh, block in zip(meshes, ranks, strict=True):
        assert len(block) == mesh.size and list(block) == list(range(block[0], block[0] + mesh.size))
        if mesh.num_nodes > 1 or mesh.size == per_node:
            assert block[0] % per_node == 0  # whole nodes
        else:
            assert block[0] % mesh.size == 0 and block[0] // per_node == block[-1] // per_node


@pytest.mark.parametrize("seed", range(30))
def test_assign_devices_packs_every_alpa_slicing(seed: int) -> None:
    rng = random.Random(seed)
    num_nodes, per_node = rng.choice([(1, 8), (2, 8), (4, 8), (8, 8), (2, 4), (3, 6), (2, 1), (5, 2)])
    shapes, left = submeshes(num_nodes, per_node), num_nodes * per_node
    meshes = []
    while left:
        meshes.append(rng.choice([mesh for mesh in shapes if mesh.size <= left]))
        left -= meshes[-1].size
    ranks = assign_devices(meshes, num_nodes=num_nodes, devices_per_node=per_node)
    check_ranks(meshes, ranks, per_node, num_nodes * per_node)


def test_assign_devices_keeps_stage_order_when_aligned() -> None:
    meshes = [Submesh(num_nodes=1, devices_per_node=m) for m in (2, 2, 4)] + [Submesh(num_nodes=2, devices_per_node=8)]
    assert assign_devices(meshes, num_nodes=3, devices_per_node=8) == [
        (0, 1),
        (2, 3),
        (4, 5, 6, 7),
        tuple(range(8, 24)),
    ]
    misaligned = [Submesh(num_nodes=1, devices_per_node=m) for m in (1, 2, 1, 4)]
    ranks = assign_devices(misaligned, num_nodes=1, devices_per_node=8)
    check_ranks(misaligned, ranks, 8, 8)
    with pytest.raises(AssertionError):
        assign_devices([Submesh(num_nodes=1, devices_per_node=4)] * 3, num_nodes=2, devices_per_node=6)


@pytest.mark.parametrize("seed", range(15))
def test_dp_over_whole_nodes_matches_brute_force(seed: int) -> None:
    """Past WHOLE_NODE_LIMIT nodes the DP counts devices in whole nodes over the divisors of N: still exact."""
    check_against_brute_force(random_case(random.Random(seed), max_layers=4, clusters=[(36, 2), (40, 1), (33, 4)]))


def test_large_clusters_use_whole_nodes_dividing_them() -> None:
    assert [mesh.num_nodes for mesh in submeshes(384, 8)] == [
        1,
        2,
        3,
        4,
        6,
        8,
        12,
        16,
        24,
        32,
        48,
        64,
        96,
        128,
        192,
        384,
    ]
    assert all(mesh.devices_per_node == 8 for mesh in submeshes(384, 8))
    assert len(submeshes(32, 8)) == 4 + 31  # up to the limit: Alpa's shapes, every n


def test_span_options_take_the_largest_peak_of_their_layers_and_sum_the_rest() -> None:
    """A stage's peak beyond what it keeps is its largest layer's (one microbatch peaks in one layer at a time);
    its gradient buckets add up (:func:`planner.inter.search._span_maxima`, :meth:`OptionArrays.memory_bytes`)."""
    import numpy as np

    from planner.inter.search import _span_maxima
    from planner.inter.stage_dp.solver import OptionArrays

    per_layer = np.array([[1.0], [5.0], [2.0]])
    maxima = _span_maxima(per_layer)
    assert maxima[0, 2, 0] == 5.0 and maxima[2, 2, 0] == 2.0 and maxima[0, 0, 0] == 1.0 and maxima[1, 0, 0] == 0.0
    one = np.array([10.0])
    arrays = OptionArrays(
        time_s=one,
        state_bytes=one,
        activation_bytes=np.array([2.0]),
        peak_extra_bytes=np.array([3.0]),
        sync_bytes=np.array([20.0]),
    )
    assert arrays.memory_bytes(4)[0] == 10.0 + max(2.0 * 4 + 3.0, 20.0)
    assert arrays.memory_bytes(8, (0,)) == 10.0 + max(2.0 * 8 + 3.0, 20.0)
