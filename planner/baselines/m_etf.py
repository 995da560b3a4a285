"""m-ETF placement (Baechi, Jeon et al. 2020): earliest-task-first list scheduling under memory limits.

The forward graph is list-scheduled one op at a time, each device running one op at a time.
An op is *ready* once all its predecessors are placed; device ``d`` can take op ``i`` when

    used[d] + memory_bytes(i) ≤ device_memory_bytes[d]     (memory is held for the whole step).

The data of ``i`` is on ``d`` at (:func:`_arrival`)

    arrival(i, d) = max_{(p, i, b) ∈ edges} finish(p) + (transfer_s(dev(p), d, b) if dev(p) ≠ d else 0),

so ``i`` could start on ``d`` at ``start(i, d) = max(free_at[d], arrival(i, d))`` and would run
for ``time_s(i) / speed[d]``. Each step places the (ready op, device with room) pair of
earliest start, ties to the larger upward rank (:func:`planner.baselines.critical_path.upward_rank`),
then the lower op index, then the lower device index; the device is then busy until the
op's finish. (Baechi's m-ETF: earliest start, memory as a hard limit.)

Implementation (:func:`m_etf_placement`): every ready op keeps one heap entry, its best
device (:func:`_best_entry`) stamped with that device's version. Placing an op on ``d`` only
delays ``d`` and fills its memory, so every other device's start time for every op is
unchanged and the entry of an op whose best device is not ``d`` stays exact; an entry for
``d`` is a lower bound, recomputed when it reaches the top. The popped fresh entry is thus
the exact minimum, in ``O(D)`` per recomputation instead of a scan of all ready pairs.
An op that fits on no device raises :class:`planner.errors.AutoplanError`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from planner.baselines.critical_path import upward_rank
from planner.baselines.hash_placement import no_device_error
from planner.baselines.placement_problem import PlacementProblem

ALGORITHM = "m-ETF placement"

# (start, -rank, op, device, version of device): heap order is the m-ETF choice with its tie-breaks.
Entry = tuple[float, float, int, int, int]


@dataclass
class _Schedule:
    """Devices (free time, bytes used, version bumped on every change) and placed ops (device, finish)."""

    problem: PlacementProblem
    free_at: list[float] = field(init=False)
    used: list[float] = field(init=False)
    version: list[int] = field(init=False)
    device: list[int] = field(init=False)
    finish: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.free_at = [0.0] * self.problem.num_devices
        self.used = [0.0] * self.problem.num_devices
        self.version = [0] * self.problem.num_devices
        self.device = [-1] * self.problem.num_ops
        self.finish = [0.0] * self.problem.num_ops

    def place(self, op: int, device: int, start: float) -> None:
        self.device[op] = device
        self.finish[op] = start + self.problem.time_s(op) / self.problem.device_speed[device]
        self.free_at[device] = self.finish[op]
        self.used[device] += self.problem.memory_bytes(op)
        self.version[device] += 1


def m_etf_placement(problem: PlacementProblem) -> tuple[int, ...]:
    """Device per op: earliest (start time) ready op-device pair first, memory-limited (Baechi 2020)."""
    rank = upward_rank(problem)
    predecessors, successors = problem.predecessors(), problem.successors()
    waiting = [len(p) for p in predecessors]  # unplaced predecessors (edges) of each op
    schedule = _Schedule(problem)
    arrival: dict[int, list[float]] = {}
    heap: list[Entry] = []

    def make_ready(op: int) -> None:
        arrival[op] = _arrival(problem, predecessors[op], schedule)
        heapq.heappush(heap, _best_entry(problem, op, rank[op], arrival[op], schedule))

    for op in range(problem.num_ops):
        if not waiting[op]:
            make_ready(op)
    while heap:
        start, _, op, device, version = heapq.heappop(heap)
        if version != schedule.version[device]:  # the device changed: the start is a lower bound
            heapq.heappush(heap, _best_entry(problem, op, rank[op], arrival[op], schedule))
            continue
        schedule.place(op, device, start)
        del arrival[op]
        for succ, _ in successors[op]:
            waiting[succ] -= 1
            if not waiting[succ]:
                make_ready(succ)
    return tuple(schedule.device)


def _arrival(problem: PlacementProblem, predecessors: list[tuple[int, float]], schedule: _Schedule) -> list[float]:
    """Per device, when all of the op's inputs are there (its predecessors are all placed)."""
    arrival = [0.0] * problem.num_devices
    for p, num_bytes in predecessors:
        source, done = schedule.device[p], schedule.finish[p]
        for d in range(problem.num_devices):
            at = done if d == source else done + problem.transfer_s(source, d, num_bytes)
            if at > arrival[d]:
                arrival[d] = at
    return arrival


def _best_entry(problem: PlacementProblem, op: int, rank: float, arrival: list[float], schedule: _Schedule) -> Entry:
    """The heap entry of ``op`` on its device with room of earliest start (ties to the lower index)."""
    need = problem.memory_bytes(op)
    capacity, used, free_at = problem.device_memory_bytes, schedule.used, schedule.free_at
    best: tuple[float, int] | None = None
    for d in range(problem.num_devices):
        if used[d] + need <= capacity[d]:
            start = max(free_at[d], arrival[d])
            if best is None or start < best[0]:
                best = (start, d)
    if best is None:
        free = [cap - u for cap, u in zip(capacity, used, strict=True)]
        raise no_device_error(problem, op, free, algorithm=ALGORITHM)
    return (best[0], -rank, op, best[1], schedule.version[best[1]])
