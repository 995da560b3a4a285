"""Seconds of forward and backward compute for one operator on one device.

Analytical roofline (:class:`RooflineCompute`), per pass::

    t = max(flops / (peak(dtype) · compute_efficiency),
            bytes / (memory_bandwidth · memory_efficiency)) + kernel_overhead_s

with the forward pass moving ``node.bytes_moved`` bytes and the backward pass twice that
(it reads the output gradient and the saved inputs and writes the input gradients). On a
device that trains in mixed precision, floating tensors move at 2 bytes per element and
matmuls run at the bf16 peak. Views cost nothing; an operator without floating inputs has
no backward.

Profiled tables (:class:`ProfiledCompute`): the measured median forward and backward times
from :mod:`cost_models.profiler`, keyed by ``OpNode.signature()``; nodes not in the table fall
back to the roofline, or are measured when first asked for (``measure``, e.g. the graph at a
microbatch size). A measured time is multiplied by the device's ``shared_slowdown`` (operators are
profiled by one process alone; a device of a calibrated local cluster is one process among several
sharing the cores). Both implement :class:`ComputeModel`.

``scale`` divides the work of a node (sharded or split over a smaller batch): compute time is
the unsharded time times ``scale``, with the kernel overhead paid once (:meth:`NodeTime.scaled`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from cost_models.cluster import DeviceSpec
from planner.ir.graph import NodeKind, OpNode


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeTime:
    fwd_s: float
    bwd_s: float
    overhead_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s

    def scaled(self, fraction: float) -> NodeTime:
        """The time of ``fraction`` of the work: variable part scales, launch overhead does not."""
        fixed_fwd = self.overhead_s if self.fwd_s > 0 else 0.0
        fixed_bwd = self.overhead_s if self.bwd_s > 0 else 0.0
        return NodeTime(
            fwd_s=fixed_fwd + (self.fwd_s - fixed_fwd) * fraction,
            bwd_s=fixed_bwd + (self.bwd_s - fixed_bwd) * fraction,
            overhead_s=self.overhead_s,
        )


class ComputeModel(Protocol):
    # True when a node's time depends on its shapes beyond its work (measured tables): a node on 1/d of
    # the batch is then priced on the graph at that batch, not as its time scaled by 1/d.
    measures_shapes: bool

    def node_time(self, node: OpNode) -> NodeTime: ...


def has_backward(node: OpNode) -> bool:
    return node.kind != NodeKind.VIEW and any(meta.is_floating for meta in node.input_metas)


@dataclass(frozen=True, kw_only=True)
class RooflineCompute:
    device: DeviceSpec
    measures_shapes = False  # the roofline of 1/d of a node's work is its time scaled by 1/d

    def _bytes(self, node: OpNode) -> float:
        if not self.device.mixed_precision or node.bytes_moved == 0:
            return float(node.bytes_moved)
        metas = (*node.input_metas, *node.outputs)
        return float(sum(meta.numel * 2 if meta.is_floating else meta.nbytes for meta in metas))

    def _dtype(self, node: OpNode) -> str:
        floating = [meta.dtype for meta in node.outputs if meta.is_floating]
        if self.device.mixed_precision and floating:
            return "bfloat16"
        return floating[0] if floating else "float32"

    def _pass_s(self, flops: float, num_bytes: float, dtype: str) -> float:
        device = self.device
        compute_s = flops / (device.peak(dtype) * device.compute_efficiency)
        memory_s = num_bytes / (device.memory_bandwidth * device.memory_efficiency)
        return max(compute_s, memory_s) + device.kernel_overhead_s

    def node_time(self, node: OpNode) -> NodeTime:
        if node.kind == NodeKind.VIEW:
            return NodeTime(fwd_s=0.0, bwd_s=0.0)
        num_bytes = self._bytes(node)
        dtype = self._dtype(node)
        fwd_s = self._pass_s(node.flops_fwd, num_bytes, dtype)
        bwd_s = self._pass_s(node.flops_bwd, 2 * num_bytes, dtype) if has_backward(node) else 0.0
        return NodeTime(fwd_s=fwd_s, bwd_s=bwd_s, overhead_s=self.device.kernel_overhead_s)


@dataclass(frozen=True, kw_only=True)
class ProfiledCompute:
    """Measured times by node signature, the roofline for anything not measured.

    ``measure``: called once for a signature missing from ``table`` (the graph at another microbatch
    size); its answer is kept, None means "use the roofline". ``slowdown``: the device's
    ``shared_slowdown``, applied to every measured time. ``overhead_s``: the fixed part of a measured
    time that does not shrink when the node is sharded (the device's kernel overhead)."""

    table: Mapping[str, NodeTime]
    fallback: ComputeModel
    measure: Callable[[OpNode], NodeTime | None] | None = None
    slowdown: float = 1.0
    overhead_s: float = 0.0
    _measured: dict[str, NodeTime | None] = field(default_factory=dict, repr=False, compare=False)
    measures_shapes = True

    def node_time(self, node: OpNode) -> NodeTime:
        measured = self._lookup(node)
        if measured is None:
            return self.fallback.node_time(node)
        fwd_s, bwd_s = measured.fwd_s * self.slowdown, measured.bwd_s * self.slowdown
        fixed = min(self.overhead_s, *(t for t in (fwd_s, bwd_s) if t > 0)) if fwd_s > 0 or bwd_s > 0 else 0.0
        return NodeTime(fwd_s=fwd_s, bwd_s=bwd_s, overhead_s=fixed)

    def _lookup(self, node: OpNode) -> NodeTime | None:
        signature = node.signature()
        if signature in self.table:
            return self.table[signature]
        if self.measure is None or node.kind == NodeKind.VIEW:
            return None
        if signature not in self._measured:
            self._measured[signature] = self.measure(node)
        return self._measured[signature]

    def coverage(self, nodes: list[OpNode]) -> float:
        """Share of ``nodes`` whose time was measured rather than estimated."""
        if not nodes:
            return 1.0
        return sum(self._lookup(node) is not None for node in nodes) / len(nodes)
