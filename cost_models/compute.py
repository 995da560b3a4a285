"""Seconds of forward and backward compute for one operator on one device.

Analytical roofline (:class:`RooflineCompute`), per pass::

    t = max(flops / (peak(dtype) · efficiency),
            bytes / (memory_bandwidth · memory_efficiency)) + kernel_overhead_s

with the forward pass moving ``node.bytes_moved`` bytes and the backward pass twice that
(it reads the output gradient and the saved inputs and writes the input gradients). On a
device that trains in mixed precision, floating tensors move at 2 bytes per element and
matmuls run at the bf16 peak. Views cost nothing; an operator without floating inputs has
no backward. ``memory_efficiency`` is the share of the data-sheet bandwidth a streaming kernel
reaches on the device (measured for the GPU presets, :mod:`cost_models.gpu_devices`).

``efficiency`` is the device's ``compute_efficiency``, except on a device with a kernel shape model
(``DeviceSpec.kernels``: the GPU presets), where it depends on the operator's shape
(:mod:`cost_models.gemm_efficiency`):

* a matmul runs its GEMM at ``gemm_efficiency(shape)`` (tile and wave quantization, the small-K
  prologue, tile operand reuse); its backward pass is the two GEMMs ``dX = dY·Wᵀ`` and ``dW = Xᵀ·dY``,
  each at its own shape (:meth:`RooflineCompute._matmul_time`);
* fused attention does its kernel's FLOPs (half of ``Sq·Sk`` when causal; 2.5× forward in backward) at
  the device's attention efficiencies (:meth:`RooflineCompute._attention_time`);
* every other operator is priced as above, on the device's own share of the work; normalization kernels at the
  device's ``norm_memory_efficiency`` of the data-sheet bandwidth;
* each pass is at least the host's time to issue it (``host_forward_s``, ``host_backward_s``:
  :meth:`RooflineCompute._host_bound`): eager PyTorch cannot launch kernels faster than that. Taken per operator,
  this is pessimistic where small operators follow large ones (the host, running ahead during a large kernel,
  issues the small ones early) and exact where every operator is small.

Devices without one (CPU processes: ``local-cpu``, calibrated ``cpu*`` clusters; cluster files that give
none) keep the flat roofline exactly.

Profiled tables (:class:`ProfiledCompute`): the measured median forward and backward times
from :mod:`cost_models.profiling.profiler`, keyed by ``OpNode.signature()``; nodes not in the table fall
back to the roofline, or are measured when first asked for (``measure``, e.g. the graph at a
microbatch size). A measured time is multiplied by the device's ``shared_slowdown`` (operators are
profiled by one process alone; a device of a calibrated local cluster is one process among several
sharing the cores). Both implement :class:`ComputeModel`.

``scale`` divides the work of a node (sharded or split over a smaller batch): compute time is
the unsharded time times ``scale``, with the kernel overhead paid once (:meth:`NodeTime.scaled`).
:meth:`ComputeModel.local_time` is a node's time on one device of a sharded strategy: the scaled time,
except under a kernel shape model, which prices the device's own share — its output dims divided by
their shard counts, the contracted dim by what is left of the shard count — by that share's shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from cost_models.device import DeviceSpec
from cost_models.gemm_efficiency import (
    GemmShape,
    attention_flops,
    backward_shapes,
    gemm_s,
    local_output_shape,
    matmul_shape,
)
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

    def local_time(self, node: OpNode, *, shards: int, output_shards: Mapping[int, int]) -> NodeTime:
        """``node``'s time on one device of a strategy that splits its work ``shards`` ways, its output's
        dim ``d`` into ``output_shards[d]`` pieces (dims not named are whole)."""
        ...


def has_backward(node: OpNode) -> bool:
    return node.kind != NodeKind.VIEW and any(meta.is_floating for meta in node.input_metas)


@dataclass(frozen=True, kw_only=True)
class RooflineCompute:
    device: DeviceSpec

    @property
    def measures_shapes(self) -> bool:
        """Under a kernel shape model a node's time depends on its shapes, not only its work; else the
        roofline of 1/d of a node's work is its time scaled by 1/d."""
        return self.device.kernels is not None

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

    def _memory_s(self, num_bytes: float, efficiency: float | None = None) -> float:
        share = self.device.memory_efficiency if efficiency is None else efficiency
        return num_bytes / (self.device.memory_bandwidth * share)

    def _pass_s(self, flops: float, num_bytes: float, dtype: str, memory_efficiency: float | None = None) -> float:
        device = self.device
        compute_s = flops / (device.peak(dtype) * device.compute_efficiency)
        return max(compute_s, self._memory_s(num_bytes, memory_efficiency)) + device.kernel_overhead_s

    def node_time(self, node: OpNode) -> NodeTime:
        if node.kind == NodeKind.VIEW:
            return NodeTime(fwd_s=0.0, bwd_s=0.0)
        if self.device.kernels is not None:
            return self.local_time(node, shards=1, output_shards={})
        return self._flat_time(node)

    def local_time(self, node: OpNode, *, shards: int, output_shards: Mapping[int, int]) -> NodeTime:
        if self.device.kernels is None:
            return self.node_time(node).scaled(1 / shards)
        if node.kind == NodeKind.VIEW:
            return NodeTime(fwd_s=0.0, bwd_s=0.0)
        return self._host_bound(self._device_time(node, shards=shards, output_shards=output_shards))

    def _device_time(self, node: OpNode, *, shards: int, output_shards: Mapping[int, int]) -> NodeTime:
        """The GPU's seconds for this device's share of the node (the kernel shape model)."""
        if node.kind == NodeKind.ATTENTION:
            return self._attention_time(node, shards=shards)
        if node.kind != NodeKind.MATMUL:
            return self._flat_time(node, shards=shards)
        if math.prod(output_shards.values()) > shards:  # an output split without a compute split: not a share
            output_shards = {}
        shape = matmul_shape(
            node, output_shape=local_output_shape(node.output, output_shards), flops=node.flops_fwd / shards
        )
        if shape is None:  # a vector product: the flat roofline
            return self._flat_time(node, shards=shards)
        return self._matmul_time(node, shape, shards=shards)

    def _host_bound(self, time: NodeTime) -> NodeTime:
        """A pass takes at least the host's time to issue it (``KernelSpec.host_forward_s``, ``host_backward_s``)."""
        spec = self.device.kernels
        assert spec is not None
        fwd_s = max(time.fwd_s, spec.host_forward_s) if time.fwd_s > 0 else 0.0
        bwd_s = max(time.bwd_s, spec.host_backward_s) if time.bwd_s > 0 else 0.0
        return NodeTime(fwd_s=fwd_s, bwd_s=bwd_s, overhead_s=time.overhead_s)

    def _flat_time(self, node: OpNode, *, shards: int = 1) -> NodeTime:
        """The roofline; with a kernel model, of this device's ``1/shards`` of the work, normalization kernels at
        their own bandwidth (``KernelSpec.norm_memory_efficiency``)."""
        num_bytes, dtype = self._bytes(node) / shards, self._dtype(node)
        spec = self.device.kernels
        efficiency = spec.norm_memory_efficiency if spec is not None and node.kind == NodeKind.NORM else None
        fwd_s = self._pass_s(node.flops_fwd / shards, num_bytes, dtype, efficiency)
        bwd_s = self._pass_s(node.flops_bwd / shards, 2 * num_bytes, dtype, efficiency) if has_backward(node) else 0.0
        return NodeTime(fwd_s=fwd_s, bwd_s=bwd_s, overhead_s=self.device.kernel_overhead_s)

    def _matmul_time(self, node: OpNode, shape: GemmShape, *, shards: int) -> NodeTime:
        """The forward GEMM at ``shape``; backward: ``dX`` and ``dW`` at theirs, scaled to the captured
        backward FLOPs (``flops_bwd / 2·flops_fwd``: 1 when both input gradients are needed)."""
        spec, overhead = self.device.kernels, self.device.kernel_overhead_s
        assert spec is not None
        peak = self.device.peak(self._dtype(node))
        num_bytes = self._bytes(node) / shards
        fwd_s = max(gemm_s(spec, shape, peak=peak), self._memory_s(num_bytes)) + overhead
        if not has_backward(node):
            return NodeTime(fwd_s=fwd_s, bwd_s=0.0, overhead_s=overhead)
        share = node.flops_bwd / (2 * node.flops_fwd)
        compute_bwd = share * sum(gemm_s(spec, part, peak=peak) for part in backward_shapes(shape))
        bwd_s = max(compute_bwd, self._memory_s(2 * num_bytes)) + overhead
        return NodeTime(fwd_s=fwd_s, bwd_s=bwd_s, overhead_s=overhead)

    def _attention_time(self, node: OpNode, *, shards: int) -> NodeTime:
        """The fused kernel's FLOPs (:func:`cost_models.gemm_efficiency.attention_flops`) at the device's
        attention efficiencies; its bytes as any operator's. A split over batch or heads keeps the shape."""
        spec, overhead = self.device.kernels, self.device.kernel_overhead_s
        assert spec is not None
        peak = self.device.peak(self._dtype(node))
        num_bytes = self._bytes(node) / shards
        work_fwd, work_bwd = attention_flops(node, flops_fwd=node.flops_fwd / shards)
        fwd_s = max(work_fwd / (peak * spec.attention_fwd_efficiency), self._memory_s(num_bytes)) + overhead
        if not has_backward(node):
            return NodeTime(fwd_s=fwd_s, bwd_s=0.0, overhead_s=overhead)
        bwd_compute = work_bwd / (peak * spec.attention_bwd_efficiency)
        bwd_s = max(bwd_compute, self._memory_s(2 * num_bytes)) + overhead
        return NodeTime(fwd_s=fwd_s, bwd_s=bwd_s, overhead_s=overhead)


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

    def local_time(self, node: OpNode, *, shards: int, output_shards: Mapping[int, int]) -> NodeTime:
        """Measured times carry no shape model: the node's time scaled by ``1/shards``."""
        return self.node_time(node).scaled(1 / shards)

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
