"""Multi-objective placement (Mayer et al. 2017): the device that best trades memory, load, traffic and speed.

Ops are placed in topological order. Op ``i`` goes on the device ``d`` with room for it
(``used[d] + memory_bytes(i) ≤ capacity[d]``) of least score, ties to the lower index
(:func:`_score`), a product of four factors, each at least 1 so that a zero term does not
erase the others:

* memory (:func:`_memory_factor`): ``1 + (used[d] + memory_bytes(i)) / capacity[d]``, the share
  of ``d``'s memory in use after placing ``i``;
* load (:func:`_load_factor`): ``1 + ((work[d] + time_s(i)) / speed[d]) / (W / S)``, the time of
  ``d``'s ops after placing ``i`` relative to a perfect balance, with ``work[d]`` the
  ``time_s`` of the ops already on ``d``, ``W`` the ``time_s`` of all ops, ``S`` the total speed;
* traffic (:func:`_traffic_factor`): ``1 + X_d / B_i``, with ``X_d`` the bytes of the edges from
  ``i``'s predecessors (all placed already) on devices other than ``d``, the traffic that
  placing ``i`` on ``d`` makes cross devices, and ``B_i`` the bytes of all of ``i``'s edges, in
  and out (the factor is 1 for an op without edges);
* importance (:func:`_importance_factor`): ``(max speed / speed[d]) ** (rank(i) / max rank)``,
  with ``rank`` the upward rank of :func:`planner.baselines.placement.critical_path.upward_rank`: ops on
  the critical path pay the full speed ratio on a slow device, ops near the end of the graph
  almost nothing.

An op that fits on no device raises :class:`planner.errors.AutoplanError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.baselines.placement.critical_path import upward_rank
from planner.baselines.placement.hash_placement import no_device_error
from planner.baselines.placement.problem import PlacementProblem

ALGORITHM = "multi-objective placement"


@dataclass
class _State:
    """What the devices hold so far (bytes used, work, device of each placed op), ``W / S`` and the top speed."""

    used: list[float]
    work: list[float]
    assignment: list[int]
    balance: float
    max_speed: float


def multi_objective_placement(problem: PlacementProblem) -> tuple[int, ...]:
    """Device per op: least product of memory, load, new traffic and importance factors (Mayer et al. 2017)."""
    rank = upward_rank(problem)
    max_rank = max(rank, default=0.0)
    predecessors = problem.predecessors()
    edge_bytes = [0.0] * problem.num_ops
    for u, v, num_bytes in problem.edges:
        edge_bytes[u] += num_bytes
        edge_bytes[v] += num_bytes
    state = _State(
        used=[0.0] * problem.num_devices,
        work=[0.0] * problem.num_devices,
        assignment=[],
        balance=math.fsum(problem.time_s(i) for i in range(problem.num_ops)) / sum(problem.device_speed),
        max_speed=max(problem.device_speed),
    )
    for op in range(problem.num_ops):
        need = problem.memory_bytes(op)
        feasible = [d for d in range(problem.num_devices) if state.used[d] + need <= problem.device_memory_bytes[d]]
        if not feasible:
            free = [cap - u for cap, u in zip(problem.device_memory_bytes, state.used, strict=True)]
            raise no_device_error(problem, op, free, algorithm=ALGORITHM)
        importance = rank[op] / max_rank if max_rank > 0 else 0.0
        incoming = _bytes_by_device(predecessors[op], state.assignment)
        device = min(feasible, key=lambda d: (_score(problem, op, d, state, incoming, edge_bytes[op], importance), d))
        state.used[device] += need
        state.work[device] += problem.time_s(op)
        state.assignment.append(device)
    return tuple(state.assignment)


def _bytes_by_device(predecessors: list[tuple[int, float]], assignment: list[int]) -> dict[int, float]:
    """Bytes that arrive at the op from each device its predecessors are on."""
    found: dict[int, float] = {}
    for p, num_bytes in predecessors:
        found[assignment[p]] = found.get(assignment[p], 0.0) + num_bytes
    return found


def _score(
    problem: PlacementProblem,
    op: int,
    device: int,
    state: _State,
    incoming: dict[int, float],
    op_edge_bytes: float,
    importance: float,
) -> float:
    return (
        _memory_factor(problem, op, device, state)
        * _load_factor(problem, op, device, state)
        * _traffic_factor(device, incoming, op_edge_bytes)
        * _importance_factor(problem, device, state, importance)
    )


def _memory_factor(problem: PlacementProblem, op: int, device: int, state: _State) -> float:
    capacity = problem.device_memory_bytes[device]
    after = state.used[device] + problem.memory_bytes(op)
    return 1.0 + (after / capacity if capacity > 0 else 0.0)


def _load_factor(problem: PlacementProblem, op: int, device: int, state: _State) -> float:
    load = (state.work[device] + problem.time_s(op)) / problem.device_speed[device]
    return 1.0 + (load / state.balance if state.balance > 0 else 0.0)


def _traffic_factor(device: int, incoming: dict[int, float], op_edge_bytes: float) -> float:
    if op_edge_bytes <= 0:
        return 1.0
    crossing = sum(incoming.values()) - incoming.get(device, 0.0)
    return 1.0 + crossing / op_edge_bytes


def _importance_factor(problem: PlacementProblem, device: int, state: _State, importance: float) -> float:
    return (state.max_speed / problem.device_speed[device]) ** importance
