"""m-ETF placement (Baechi, Jeon et al. 2020): earliest-task-first list scheduling under memory limits.

The forward graph is list-scheduled one op at a time, each device running one op at a time.
An op is *ready* once all its predecessors are placed; device ``d`` can take op ``i`` when

    used[d] + memory_bytes(i) ≤ device_memory_bytes[d]     (memory is held for the whole step).

The data of ``i`` is on ``d`` at (:func:`_arrival`)

    arrival(i, d) = max_{(p, i, b) ∈ edges} finish(p) + (transfer_s(dev(p), d, b) if dev(p) ≠ d else 0),

so ``i`` could start on ``d`` at ``start(i, d) = max(free_at[d], arrival(i, d))`` and would run
for ``time_s(i) / speed[d]``. Each step places the (ready op, device with room) pair of
earliest start, ties to the larger upward rank (:func:`planner.baselines.placement.critical_path.upward_rank`),
then the lower op index, then the lower device index; the device is then busy until the
op's finish. (Baechi's m-ETF: earliest start, memory as a hard limit.)

Implementation (:func:`m_etf_placement`): each device keeps its ready ops in two heaps
(:class:`_DeviceQueue`): those whose data is there by the time the device is free (start =
free time, best by ``(-rank, op)``) and those still in flight (best by ``(arrival, -rank, op)``),
and caches its best entry. Placing an op on ``d`` only delays ``d`` and fills its memory, so
only ``d``'s queue and the queues whose best was that op are recomputed; ops placed elsewhere,
or that no longer fit (memory only fills), leave the heaps lazily. A step takes the least of
the ``D`` cached entries: ``O(D)`` plus amortised heap work, about ``O(N·D·log N)`` in all,
where scanning every ready pair would be ``O(N²·D)`` on a wide graph.
An op that fits on no device raises :class:`planner.errors.AutoplanError`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from planner.baselines.placement.critical_path import upward_rank
from planner.baselines.placement.hash_placement import no_device_error
from planner.baselines.placement.problem import PlacementProblem

ALGORITHM = "m-ETF placement"

# (start, -rank, op): a device's choice in m-ETF's order; the device index breaks the last ties.
Entry = tuple[float, float, int]


@dataclass
class _Schedule:
    """Devices (free time, bytes free) and ops (device, finish, memory); ``device[op] < 0``: not placed."""

    problem: PlacementProblem
    free_at: list[float] = field(init=False)
    room: list[float] = field(init=False)
    device: list[int] = field(init=False)
    finish: list[float] = field(init=False)
    memory: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.free_at = [0.0] * self.problem.num_devices
        self.room = list(self.problem.device_memory_bytes)
        self.device = [-1] * self.problem.num_ops
        self.finish = [0.0] * self.problem.num_ops
        self.memory = [self.problem.memory_bytes(op) for op in range(self.problem.num_ops)]

    def place(self, op: int, device: int, start: float) -> None:
        self.device[op] = device
        self.finish[op] = start + self.problem.time_s(op) / self.problem.device_speed[device]
        self.free_at[device] = self.finish[op]
        self.room[device] -= self.memory[op]


class _DeviceQueue:
    """The ready ops of one device: arrived by its free time (by rank) and still in flight (by arrival)."""

    def __init__(self, device: int, schedule: _Schedule) -> None:
        self.device, self.schedule = device, schedule
        self.arrived: list[tuple[float, int]] = []  # (-rank, op)
        self.in_flight: list[tuple[float, float, int]] = []  # (arrival, -rank, op)
        self.top: Entry | None = None
        self.stale = False  # the device changed: recompute ``top`` before use

    def push(self, arrival: float, neg_rank: float, op: int) -> None:
        if self.schedule.memory[op] > self.schedule.room[self.device]:
            return  # never fits here: the device's memory only fills
        free_at = self.schedule.free_at[self.device]
        if arrival <= free_at:
            heapq.heappush(self.arrived, (neg_rank, op))
            entry = (free_at, neg_rank, op)
        else:
            heapq.heappush(self.in_flight, (arrival, neg_rank, op))
            entry = (arrival, neg_rank, op)
        if not self.stale and (self.top is None or entry < self.top):
            self.top = entry

    def best(self) -> Entry | None:
        """``(start, -rank, op)`` of the best usable op (recomputed only when something changed)."""
        if self.stale or (self.top is not None and self.schedule.device[self.top[2]] >= 0):
            self.top, self.stale = self._recompute(), False
        return self.top

    def _recompute(self) -> Entry | None:
        free_at, room = self.schedule.free_at[self.device], self.schedule.room[self.device]
        placed, memory = self.schedule.device, self.schedule.memory
        while self.in_flight and self.in_flight[0][0] <= free_at:
            _, neg_rank, op = heapq.heappop(self.in_flight)
            heapq.heappush(self.arrived, (neg_rank, op))
        while self.arrived and (placed[self.arrived[0][1]] >= 0 or memory[self.arrived[0][1]] > room):
            heapq.heappop(self.arrived)
        if self.arrived:
            return (free_at, *self.arrived[0])
        while self.in_flight and (placed[self.in_flight[0][2]] >= 0 or memory[self.in_flight[0][2]] > room):
            heapq.heappop(self.in_flight)
        return self.in_flight[0] if self.in_flight else None


def m_etf_placement(problem: PlacementProblem) -> tuple[int, ...]:
    """Device per op: earliest (start time) ready op-device pair first, memory-limited (Baechi 2020)."""
    rank = upward_rank(problem)
    predecessors, successors = problem.predecessors(), problem.successors()
    waiting = [len(p) for p in predecessors]  # unplaced predecessors (edges) of each op
    schedule = _Schedule(problem)
    queues = [_DeviceQueue(d, schedule) for d in range(problem.num_devices)]
    ready: set[int] = set()

    def make_ready(op: int) -> None:
        ready.add(op)
        for queue, at in zip(queues, _arrival(problem, predecessors[op], schedule), strict=True):
            queue.push(at, -rank[op], op)

    for op in range(problem.num_ops):
        if not waiting[op]:
            make_ready(op)
    while (choice := _earliest(queues)) is not None:
        (start, _, op), device = choice
        schedule.place(op, device, start)
        queues[device].stale = True
        ready.discard(op)
        for succ, _ in successors[op]:
            waiting[succ] -= 1
            if not waiting[succ]:
                make_ready(succ)
    if ready:  # ready ops that fit on no device (memory only fills, so they never will)
        raise no_device_error(problem, min(ready), schedule.room, algorithm=ALGORITHM)
    return tuple(schedule.device)


def _earliest(queues: list[_DeviceQueue]) -> tuple[Entry, int] | None:
    """The least ``((start, -rank, op), device)`` over the devices' best ops, or None when none is usable."""
    best: tuple[Entry, int] | None = None
    for d, queue in enumerate(queues):
        top = queue.best()
        if top is not None and (best is None or top < best[0]):
            best = (top, d)
    return best


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
