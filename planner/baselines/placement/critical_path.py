"""Critical-path placement (Mayer et al. 2017): the longest path on the fastest device, the rest balanced.

Upward rank (:func:`upward_rank`), the longest remaining path from op ``i`` to a sink, on the
fastest device and with a transfer on every edge:

    rank(i) = time_s(i) / max_d speed[d] + max_{(i, j, b) ∈ edges} (T(b) + rank(j))     (0 for a sink),

where ``T(b)`` (:func:`mean_transfer`) is the mean of ``transfer_s(0, d, b)`` over ``d = 1 … D-1``,
the mean over all pairs of distinct devices when every device sees the same set of links
(nodes of equal size), and 0 on one device. It is the forward transfer of one microbatch, as
in m-ETF (:mod:`planner.baselines.placement.m_etf`), which uses the same rank for ties.

The critical path (:func:`critical_path`) starts at the source (no predecessors) of largest
rank and repeatedly follows the successor ``j`` that attains the maximum above (largest
``T(b) + rank(j)``, ties to the lower index) until a sink, so its length is the source's rank.

Placement (:func:`critical_path_placement`): the whole path goes on the first device, in order
of speed (fastest first, ties by index), whose memory holds all of it; when none does, the
fastest device with the most memory takes as many path ops as fit, in path order, and the rest
are placed like the other ops. Every other op, in topological order, goes on the device with
room for it whose load after placing it, ``(work[d] + time_s(i)) / speed[d]``, is least
(``work`` = sum of ``time_s`` of the ops already there, path included; ties to the lower index).
Using the load *after* placing makes a fast device win a tie of empty devices.
"""

from __future__ import annotations

from collections.abc import Callable

from planner.baselines.placement.hash_placement import no_device_error
from planner.baselines.placement.problem import PlacementProblem

ALGORITHM = "critical-path placement"


def critical_path_placement(problem: PlacementProblem) -> tuple[int, ...]:
    """Device per op: critical path on the fastest device that holds it, the rest least-loaded first."""
    rank = upward_rank(problem)
    assignment: list[int | None] = [None] * problem.num_ops
    free = list(problem.device_memory_bytes)
    work = [0.0] * problem.num_devices
    path = critical_path(problem, rank)
    device = _path_device(problem, path)
    for op in path:
        need = problem.memory_bytes(op)
        if need <= free[device]:
            assignment[op] = device
            free[device] -= need
            work[device] += problem.time_s(op)
    for op in range(problem.num_ops):
        if assignment[op] is None:
            assignment[op] = _least_loaded(problem, op, free, work, algorithm=ALGORITHM)
    return tuple(d for d in assignment if d is not None)


def mean_transfer(problem: PlacementProblem) -> Callable[[float], float]:
    """``T(b)``: mean seconds to send ``b`` bytes from device 0 to another device (0 on one device)."""
    others = range(1, problem.num_devices)
    cache: dict[float, float] = {}

    def transfer(num_bytes: float) -> float:
        if num_bytes not in cache:
            total = sum(problem.transfer_s(0, d, num_bytes) for d in others)
            cache[num_bytes] = total / len(others) if others else 0.0
        return cache[num_bytes]

    return transfer


def upward_rank(problem: PlacementProblem) -> list[float]:
    """Longest remaining path (seconds) from each op to a sink, op time on the fastest device plus ``T(b)``."""
    fastest = max(problem.device_speed)
    transfer = mean_transfer(problem)
    successors = problem.successors()
    rank = [0.0] * problem.num_ops
    for op in reversed(range(problem.num_ops)):
        tail = max((transfer(b) + rank[v] for v, b in successors[op]), default=0.0)
        rank[op] = problem.time_s(op) / fastest + tail
    return rank


def critical_path(problem: PlacementProblem, rank: list[float]) -> list[int]:
    """Ops of the path from the highest-rank source along the successors that attain each rank."""
    if problem.num_ops == 0:
        return []
    transfer = mean_transfer(problem)
    successors = problem.successors()
    has_predecessor = {v for _, v, _ in problem.edges}
    sources = [op for op in range(problem.num_ops) if op not in has_predecessor]
    op = max(sources, key=lambda s: (rank[s], -s))
    path = [op]
    while successors[op]:
        op = max(successors[op], key=lambda edge: (transfer(edge[1]) + rank[edge[0]], -edge[0]))[0]
        path.append(op)
    return path


def _path_device(problem: PlacementProblem, path: list[int]) -> int:
    """The fastest device (ties by index) that holds the whole path, else the fastest with the most memory."""
    need = sum(problem.memory_bytes(op) for op in path)
    speed, capacity = problem.device_speed, problem.device_memory_bytes
    by_speed = sorted(range(problem.num_devices), key=lambda d: (-speed[d], d))
    whole = next((d for d in by_speed if need <= capacity[d]), None)
    if whole is not None:
        return whole
    return min(problem.fastest_devices(), key=lambda d: (-capacity[d], d))


def _least_loaded(problem: PlacementProblem, op: int, free: list[float], work: list[float], *, algorithm: str) -> int:
    """Place ``op`` on the device with room whose load after placing is least; update ``free`` and ``work``."""
    need, time = problem.memory_bytes(op), problem.time_s(op)
    speed = problem.device_speed
    feasible = [d for d in range(problem.num_devices) if need <= free[d]]
    if not feasible:
        raise no_device_error(problem, op, free, algorithm=algorithm)
    device = min(feasible, key=lambda d: ((work[d] + time) / speed[d], d))
    free[device] -= need
    work[device] += time
    return device
