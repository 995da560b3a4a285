"""The logical meshes a stage's devices can form (Alpa §4).

Logical meshes of ``D`` devices (:func:`logical_meshes`): the 1-D mesh ``(D,)`` and the 2-D
meshes ``(D/t, t)`` for every ``t`` dividing both ``D`` and the devices per node with
``1 < t < D`` — the inner axis stays inside a node, as Alpa's ``(dp, mp)`` with mp ≤ devices
per node.
"""

from __future__ import annotations


def logical_meshes(num_devices: int, devices_per_node: int) -> list[tuple[int, ...]]:
    """The 1-D mesh of ``num_devices`` and every 2-D mesh whose inner axis stays inside a node."""
    shapes: list[tuple[int, ...]] = [(num_devices,)]
    for inner in range(2, min(num_devices, devices_per_node) + 1):
        if num_devices % inner == 0 and devices_per_node % inner == 0 and inner < num_devices:
            shapes.append((num_devices // inner, inner))
    return shapes
