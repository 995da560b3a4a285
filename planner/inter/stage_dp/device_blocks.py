"""Submeshes and where they sit: global ranks for a pipeline's submeshes, whole nodes for ``(n, M)``,
aligned blocks for ``(1, m)``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Submesh:
    """A block of ``num_nodes`` × ``devices_per_node`` devices: Alpa's ``(1, m)`` and ``(n, M)`` shapes."""

    num_nodes: int
    devices_per_node: int

    @property
    def size(self) -> int:
        return self.num_nodes * self.devices_per_node


def assign_devices(meshes: Sequence[Submesh], *, num_nodes: int, devices_per_node: int) -> list[tuple[int, ...]]:
    """Global ranks (``node·M + local``) per stage: whole-node submeshes on whole nodes, ``(1, m)`` on
    blocks aligned to ``m`` inside one node.

    First in stage order, so consecutive stages sit on the same or adjacent nodes; if that misaligns a
    block, largest first. That always packs Alpa's shapes summing to ``N·M`` (whole nodes, and ``(1, m)``
    with ``m`` a power of two dividing ``M``): descending, every offset is a sum of multiples of the
    current size, so each block is aligned, and an aligned block of ``m | M`` devices never crosses a
    node. AssertionError if the submeshes do not pack.
    """
    starts = _pack(meshes, range(len(meshes)), devices_per_node)
    if starts is None:
        starts = _pack(meshes, sorted(range(len(meshes)), key=lambda s: -meshes[s].size), devices_per_node)
    if starts is None or sum(mesh.size for mesh in meshes) > num_nodes * devices_per_node:
        shapes = [(mesh.num_nodes, mesh.devices_per_node) for mesh in meshes]
        raise AssertionError(f"submeshes {shapes} do not pack into {num_nodes} nodes of {devices_per_node} devices")
    return [tuple(range(starts[s], starts[s] + mesh.size)) for s, mesh in enumerate(meshes)]


def _pack(meshes: Sequence[Submesh], order: Sequence[int], devices_per_node: int) -> dict[int, int] | None:
    """First rank of each submesh, placed back to back in ``order``; None where one is misaligned."""
    starts, offset = {}, 0
    for s in order:
        whole = meshes[s].num_nodes > 1
        align = devices_per_node if whole else meshes[s].size
        if (whole and meshes[s].devices_per_node != devices_per_node) or devices_per_node % align or offset % align:
            return None
        starts[s], offset = offset, offset + meshes[s].size
    return starts
