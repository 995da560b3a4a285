"""Sharding specs in DTensor's vocabulary and the cost of converting between them.

A :class:`ShardingSpec` gives one placement per mesh axis: ``S(d)`` (tensor dim ``d`` is split
over that axis), ``R`` (replicated) or ``R*`` (:data:`GATHERED`: replicated in forward, its gradient
handed back as partial sums — Megatron sequence parallelism's ``g``, see
:mod:`planner.sharding.sequence_parallel`). Partial sums (``P``) exist only inside an operator's
strategy — a contraction split over an axis all-reduces (or reduce-scatters) its output there — so
specs on edges between operators are ``S``/``R``/``R*``. A dim split on several axes is split by the
product of their sizes, in axis order, as DTensor does.

:func:`reshard_s` — time to turn a producer's output spec into the spec a consumer needs,
forward and backward together, per mesh axis ``a`` (n devices, tensor bytes b local to the
other axes' sharding, :mod:`cost_models.communication` formulas):

* ``S(d) → R``: all-gather forward, a free local slice of the gradient backward;
* ``R → S(d)``: a free local slice forward, an all-gather of the gradient backward;
* ``S(d) → S(e)``: all-to-all forward and backward;
* unchanged: 0;
* ``R* → R*``: 0 — the producer gathered its output and reduce-scatters the partial gradients its
  readers hand back (its own collectives);
* ``X → R*`` from anything else: as ``X → R``, plus an all-reduce of the gradient backward (the
  partial gradient is reduced on the edge, as a column-parallel input's own all-reduce would);
* ``R* → S(d)``: a local slice forward, and backward the reader's gradient shard goes back as a
  partial sum (zeros elsewhere, no communication) that the producer's reduce-scatter sums with the
  others — when no other axis splits ``d`` (:func:`locally_sliced_axes`); else as ``R → S(d)``;
* ``R* → R``: nothing (the producer's own reduce-scatter follows in backward).

When several axes change, they change one at a time (slices, then all-to-alls, then gathers
from the last axis back), each on the tensor as the earlier steps left it, so gathering a
tensor split on two axes brings (n₀n₁−1)/(n₀n₁) of its whole size to each device, as it must.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from cost_models.cluster import Cluster, Link
from cost_models.communication import (
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    axis_link,
    bucketed_all_reduce_s,
    reduce_scatter_s,
)
from planner.ir.graph import TensorMeta

REPLICATE = "R"
GATHERED = "R*"  # replicated, gradient handed back partial (planner.sharding.sequence_parallel)
_SHARD = re.compile(r"^S\((\d+)\)$")


def shard(dim: int) -> str:
    return f"S({dim})"


def shard_dim(placement: str) -> int | None:
    """``"S(2)"`` -> 2; ``"R"`` -> None."""
    match = _SHARD.match(placement)
    return int(match.group(1)) if match else None


@dataclass(frozen=True, slots=True)
class ShardingSpec:
    placements: tuple[str, ...]

    @classmethod
    def replicated(cls, num_axes: int) -> ShardingSpec:
        return cls((REPLICATE,) * num_axes)

    def __str__(self) -> str:
        return f"[{', '.join(self.placements)}]"

    def dim_of(self, axis: int) -> int | None:
        return shard_dim(self.placements[axis])

    def shards_per_dim(self, mesh_shape: Sequence[int]) -> dict[int, int]:
        result: dict[int, int] = {}
        for axis, placement in enumerate(self.placements):
            dim = shard_dim(placement)
            if dim is not None:
                result[dim] = result.get(dim, 1) * mesh_shape[axis]
        return result

    def num_shards(self, mesh_shape: Sequence[int]) -> int:
        return math.prod(self.shards_per_dim(mesh_shape).values())

    def fits(self, shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
        """Every sharded dim exists and divides evenly."""
        return all(
            dim < len(shape) and shape[dim] % shards == 0 for dim, shards in self.shards_per_dim(mesh_shape).items()
        )

    def is_replicated(self) -> bool:
        return all(placement == REPLICATE for placement in self.placements)

    def with_placement(self, axis: int, placement: str) -> ShardingSpec:
        """This spec with ``placement`` on mesh ``axis``."""
        return ShardingSpec((*self.placements[:axis], placement, *self.placements[axis + 1 :]))

    def as_replicated(self) -> ShardingSpec:
        """``R*`` read as ``R`` (what the value is in forward)."""
        return ShardingSpec(tuple(REPLICATE if p == GATHERED else p for p in self.placements))


@dataclass(frozen=True, kw_only=True)
class StageMesh:
    """A stage's devices laid out as a logical mesh, with the link of each axis."""

    cluster: Cluster
    devices: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    activation_itemsize: int | None = None
    # seconds of resharding already worked out on this mesh, by (source, target, bytes, requires_grad)
    reshard_cache: dict[tuple, float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        assert math.prod(self.mesh_shape) == len(self.devices), "mesh shape must hold the stage's devices"

    @property
    def num_axes(self) -> int:
        return len(self.mesh_shape)

    @cached_property
    def links(self) -> tuple[Link, ...]:
        """The link each mesh axis communicates over."""
        return tuple(axis_link(self.cluster, self.devices, self.mesh_shape, a) for a in range(self.num_axes))

    def link(self, axis: int) -> Link:
        return self.links[axis]

    def tensor_bytes(self, meta: TensorMeta) -> float:
        """Bytes of a whole tensor as trained (floating tensors at the activation itemsize)."""
        if self.activation_itemsize is not None and meta.is_floating:
            return float(meta.numel * self.activation_itemsize)
        return float(meta.nbytes)

    def local_bytes(self, meta: TensorMeta, spec: ShardingSpec) -> float:
        return self.tensor_bytes(meta) / spec.num_shards(self.mesh_shape)

    def all_reduce_s(self, num_bytes: float, axis: int) -> float:
        return all_reduce_s(num_bytes, num_devices=self.mesh_shape[axis], link=self.link(axis))

    def grad_sync_s(self, num_bytes: float, axis: int) -> float:
        """A parameter's gradient sync over ``axis`` on a sharded stage, as the intra-op problem adds it up:
        its additive share of a bucketed all-reduce (the executor packs a stage's gradients into DDP-sized
        buckets, :mod:`executors.parallel.grad_sync`); the estimate and the simulator charge the exact buckets,
        overlapped with the last backward (:mod:`planner.costing.overlap`)."""
        return bucketed_all_reduce_s(num_bytes, num_devices=self.mesh_shape[axis], link=self.link(axis))

    def all_gather_s(self, num_bytes: float, axis: int) -> float:
        return all_gather_s(num_bytes, num_devices=self.mesh_shape[axis], link=self.link(axis))

    def reduce_scatter_s(self, num_bytes: float, axis: int) -> float:
        return reduce_scatter_s(num_bytes, num_devices=self.mesh_shape[axis], link=self.link(axis))

    def collective_s(self, kind: str, num_bytes: float, axis: int) -> float:
        """One of a node's own collectives (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``)
        over ``axis`` on a tensor of ``num_bytes`` local to the other axes (the whole size on ``axis``)."""
        if kind == "all_reduce":
            return self.all_reduce_s(num_bytes, axis)
        if kind == "all_to_all":
            return self.all_to_all_s(num_bytes, axis)
        if kind == "reduce_scatter":
            return self.reduce_scatter_s(num_bytes, axis)
        return self.all_gather_s(num_bytes, axis)

    def gathered_bytes(self, meta: TensorMeta, spec: ShardingSpec, axis: int) -> float:
        """Bytes of the tensor a collective over ``axis`` moves: local to the other axes, whole on ``axis``."""
        return self.local_bytes(meta, spec.with_placement(axis, REPLICATE))

    def all_to_all_s(self, num_bytes: float, axis: int) -> float:
        return all_to_all_s(num_bytes, num_devices=self.mesh_shape[axis], link=self.link(axis))


def reshard_s(
    source: ShardingSpec, target: ShardingSpec, meta: TensorMeta, mesh: StageMesh, *, requires_grad: bool = True
) -> float:
    """Forward (+ backward when the tensor requires grad) seconds from ``source`` to ``target``."""
    if source == target:
        return 0.0
    whole = mesh.tensor_bytes(meta)
    key = (source.placements, target.placements, whole, requires_grad)
    if (seconds := mesh.reshard_cache.get(key)) is None:
        sliced = source.as_replicated()
        for axis in locally_sliced_axes(source, target):
            sliced = sliced.with_placement(axis, target.placements[axis])
        seconds = _reshard_steps_s(sliced, target.as_replicated(), whole, mesh, requires_grad=requires_grad)
        if requires_grad:
            seconds += _partial_gradient_s(source, target, meta, mesh)
        mesh.reshard_cache[key] = seconds
    return seconds


def locally_sliced_axes(source: ShardingSpec, target: ShardingSpec) -> list[int]:
    """Axes on which a gathered tensor (``R*``) is read as a shard ``S(d)`` that no other axis of ``target``
    splits: sliced locally, its gradient handed back as a partial sum without communication."""
    dims = [shard_dim(placement) for placement in target.placements]
    return [
        axis
        for axis, (before, dim) in enumerate(zip(source.placements, dims, strict=True))
        if before == GATHERED and dim is not None and dims.count(dim) == 1
    ]


def partial_gradient_axes(source: ShardingSpec, target: ShardingSpec) -> list[int]:
    """Axes on which a reader of ``target`` hands back a partial gradient that the edge itself must all-reduce:
    ``R*`` read from anything but a producer that gathered its output (``R*``)."""
    return [
        axis
        for axis, (before, after) in enumerate(zip(source.placements, target.placements, strict=True))
        if after == GATHERED and before != GATHERED
    ]


def _partial_gradient_s(source: ShardingSpec, target: ShardingSpec, meta: TensorMeta, mesh: StageMesh) -> float:
    return sum(
        mesh.all_reduce_s(mesh.gathered_bytes(meta, target, axis), axis)
        for axis in partial_gradient_axes(source, target)
    )


def _reshard_steps_s(
    source: ShardingSpec, target: ShardingSpec, whole: float, mesh: StageMesh, *, requires_grad: bool
) -> float:
    total = 0.0
    changed = [axis for axis in range(mesh.num_axes) if source.placements[axis] != target.placements[axis]]
    slices = [axis for axis in changed if source.placements[axis] == REPLICATE]
    gathers = [axis for axis in reversed(changed) if target.placements[axis] == REPLICATE]
    exchanges = [axis for axis in changed if axis not in slices and axis not in gathers]
    # One axis at a time, slices first and gathers last, each on the tensor as the earlier steps
    # left it: a gather's full size is the tensor local to the other axes' *current* sharding.
    current = list(source.placements)
    for axis in (*slices, *exchanges, *gathers):
        before, after = source.placements[axis], target.placements[axis]
        others = math.prod(
            mesh.mesh_shape[other] for other in range(mesh.num_axes) if other != axis and current[other] != REPLICATE
        )
        num_bytes = whole / others
        if before == REPLICATE:
            total += mesh.all_gather_s(num_bytes, axis) if requires_grad else 0.0
        elif after == REPLICATE:
            total += mesh.all_gather_s(num_bytes, axis)
        else:
            passes = 2 if requires_grad else 1
            total += passes * mesh.all_to_all_s(num_bytes / mesh.mesh_shape[axis], axis)
        current[axis] = after
    return total
