"""Hash placement (Mayer et al. 2017): round-robin over the devices, skipping full ones.

A counter ``c`` starts at device 0. Ops are taken in topological order; op ``i`` goes to the
first device ``d = (c + k) mod D``, ``k = 0, 1, …, D - 1``, whose free memory holds it,

    used[d] + memory_bytes(i) ≤ device_memory_bytes[d]     (:meth:`PlacementProblem.memory_bytes`),

and the counter moves to ``d + 1``. With ample memory every device gets ``⌊N/D⌋`` or ``⌈N/D⌉``
ops; the algorithm ignores speeds, times and traffic, which is what makes it the floor the
other baselines are measured against. An op that fits on no device raises
:class:`planner.errors.AutoplanError` (:func:`no_device_error`, shared by every baseline).
"""

from __future__ import annotations

from collections.abc import Sequence

from cost_models.units import GIB
from planner.baselines.placement.problem import PlacementProblem
from planner.errors import AutoplanError


def hash_placement(problem: PlacementProblem) -> tuple[int, ...]:
    """Device per op: round-robin from a counter, first device with room (Mayer et al. 2017)."""
    num_devices = problem.num_devices
    free = list(problem.device_memory_bytes)
    assignment: list[int] = []
    counter = 0
    for op in range(problem.num_ops):
        need = problem.memory_bytes(op)
        device = next(
            (d % num_devices for d in range(counter, counter + num_devices) if need <= free[d % num_devices]), None
        )
        if device is None:
            raise no_device_error(problem, op, free, algorithm="hash placement")
        free[device] -= need
        assignment.append(device)
        counter = (device + 1) % num_devices
    return tuple(assignment)


def no_device_error(problem: PlacementProblem, op: int, free: Sequence[float], *, algorithm: str) -> AutoplanError:
    """The one-line error for op ``op`` that fits in none of the ``free`` bytes left on the devices."""
    capacities = problem.device_memory_bytes
    if len(set(capacities)) == 1:
        capacity = f"capacity {capacities[0] / GIB:.2f} GiB each"
    else:
        capacity = f"capacities {min(capacities) / GIB:.2f} to {max(capacities) / GIB:.2f} GiB"
    return AutoplanError(
        f"{algorithm}: op {problem.names[op]} needs {problem.memory_bytes(op) / GIB:.2f} GiB but no device has "
        f"that much free (most free {max(free) / GIB:.2f} GiB, {capacity}): use more devices or a smaller batch"
    )
