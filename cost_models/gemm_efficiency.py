"""How fast a GPU runs one matmul or one fused attention, from its shape: the kernel model of a device.

A GEMM of ``batch`` independent ``M×N`` outputs with inner dimension ``K`` (``2·batch·M·N·K`` FLOPs)
runs as cuBLAS runs it (NVIDIA, "Matrix Multiplication Background User's Guide", DU-09799-001,
§2.1 and §3): the output is cut into ``Mt×Nt`` tiles, one thread block each, and the thread blocks run
in *waves* of one per SM. For a tile shape ``T`` (:data:`CUBLAS_TILES`) the time is::

    tiles(T)  = batch · ⌈M/Mt⌉ · ⌈N/Nt⌉                        tile quantization   — num_tiles
    waves(T)  = ⌈tiles(T) / num_sms⌉                            wave quantization   — num_waves
    wave_s(T) = 2·Mt·Nt·(K + k_prologue) / (peak · e_tile(T) / num_sms)
    e_tile(T) = min(1, l2_bandwidth · Mt·Nt/(Mt+Nt) / peak)     operand reuse       — tile_efficiency
    t(T)      = waves(T) · wave_s(T)

and cuBLAS's heuristic is taken to pick the fastest tile: ``t = min_T t(T)`` (:func:`kernel_s`).
``k_prologue`` is the main loop's pipeline fill, in K elements: a tile loads ``stages − 1`` slices of
A and B before its first multiply, so a small-K GEMM does proportionally more waiting (small-K
penalty). A GEMM with few rows (small M) loses through the tile that is mostly empty (tile
quantization) and through the roofline's memory term: its bytes (the whole weight) barely shrink
with M. ``e_tile`` is the share of the tensor cores a tile keeps busy when its operands come from
L2: a tile does ``2·Mt·Nt`` FLOPs per ``2·(Mt+Nt)`` bytes of each K step. Not modelled: split-K (cuBLAS
may split a large K over more thread blocks when there are few output tiles, e.g. a tensor-parallel
``dW``; the model prices such a GEMM on its output tiles alone, so slower than it may run), epilogues
(bias, activation) and layouts (the backward GEMMs' transposed operands).

The shape factor ``f(shape) = 2·batch·M·N·K / (peak · t)`` (:func:`shape_factor`) is at most 1. The
device's ``gemm_efficiency`` is a measured fraction of peak at a published shape ``reference``
(the best shape of a maximum-achievable-matmul-FLOPs search), so a GEMM runs at::

    efficiency(shape) = gemm_efficiency · f(shape) / f(reference)          — gemm_efficiency

A linear layer's backward pass is two GEMMs with their own shapes (:func:`backward_shapes`):
``dX = dY·Wᵀ`` (``M×K`` outputs, inner ``N``) and ``dW = Xᵀ·dY`` (``K×N`` outputs, inner ``M``).

Fused attention (``scaled_dot_product_attention``: FlashAttention on A100/H100, memory-efficient
attention on V100) does ``4·B·H·Sq·Sk·D`` FLOPs forward, half of it when causal (the masked
blocks are skipped), and 2.5 times that backward (it recomputes ``Q·Kᵀ``), the FlashAttention
benchmarks' accounting; it runs at the device's ``attention_fwd_efficiency`` and
``attention_bwd_efficiency`` of peak (:func:`attention_flops`).

Beyond FLOPs and bytes (:class:`~cost_models.compute.RooflineCompute`): each pass of an operator also pays the
device's ``kernel_overhead_s`` on the GPU's timeline (the gap between back-to-back kernels), and is never shorter
than the host's ``host_forward_s`` / ``host_backward_s``, the time eager PyTorch takes to issue one operator call
(a GPU cannot run kernels faster than its host launches them); normalization kernels stream at the device's
``norm_memory_efficiency`` of the data-sheet bandwidth, not the streaming one.

The device constants (:class:`KernelSpec`) are set once per device in
:mod:`cost_models.gpu_devices`, each with its source.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any, NamedTuple

from planner.errors import AutoplanError
from planner.ir.graph import OpNode, TensorMeta

# The thread-block tile shapes cuBLAS uses, from the most to the least efficient (Matrix Multiplication
# Background User's Guide, §2.3 "Typical Tile Dimensions in cuBLAS and Performance"; the same shapes name
# the cuBLAS kernels, e.g. ampere_fp16_s16816gemm_fp16_256x128_ldg8_f2f_stages_64x3_nn).
CUBLAS_TILES: tuple[tuple[int, int], ...] = (
    (256, 128),
    (128, 256),
    (128, 128),
    (256, 64),
    (64, 256),
    (128, 64),
    (64, 128),
    (64, 64),
)


@dataclass(frozen=True, kw_only=True)
class KernelSpec:
    """The shape model of one GPU (see the module docstring for each term)."""

    num_sms: int
    l2_bandwidth: float  # bytes/s from L2 to the SMs: how well a tile shape keeps the tensor cores fed
    k_prologue: int  # K elements of main-loop time each tile spends filling its pipeline
    gemm_efficiency: float  # measured fraction of peak at ``gemm_reference``
    gemm_reference: tuple[int, int, int]  # (M, N, K) of that measurement
    attention_fwd_efficiency: float  # fused attention, of peak, FLOPs counted as in the module docstring
    attention_bwd_efficiency: float
    tiles: tuple[tuple[int, int], ...] = CUBLAS_TILES
    # host seconds of one eager operator call, forward and backward: a pass is never faster than the host issues it
    host_forward_s: float = 0.0
    host_backward_s: float = 0.0
    # share of the data-sheet bandwidth normalization kernels reach (None: the device's streaming memory_efficiency)
    norm_memory_efficiency: float | None = None

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["gemm_reference"] = list(self.gemm_reference)
        data["tiles"] = [list(tile) for tile in self.tiles]
        return data

    @classmethod
    def from_json(cls, data: Any, *, where: str) -> KernelSpec:
        """Parse ``device.kernels`` of a cluster file; a missing or wrong field is an AutoplanError."""
        if not isinstance(data, Mapping):
            raise AutoplanError(f"{where}: device.kernels must be a table of the fields of KernelSpec")
        try:
            spec = cls(
                num_sms=int(data["num_sms"]),
                l2_bandwidth=float(data["l2_bandwidth"]),
                k_prologue=int(data["k_prologue"]),
                gemm_efficiency=float(data["gemm_efficiency"]),
                gemm_reference=_ints(data["gemm_reference"], 3),
                attention_fwd_efficiency=float(data["attention_fwd_efficiency"]),
                attention_bwd_efficiency=float(data["attention_bwd_efficiency"]),
                tiles=tuple(_ints(tile, 2) for tile in data.get("tiles", CUBLAS_TILES)),
                host_forward_s=float(data.get("host_forward_s", 0.0)),
                host_backward_s=float(data.get("host_backward_s", 0.0)),
                norm_memory_efficiency=None
                if data.get("norm_memory_efficiency") is None
                else float(data["norm_memory_efficiency"]),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise AutoplanError(f"{where}: device.kernels is missing or has a wrong field ({error})") from None
        positive = (
            spec.num_sms,
            spec.l2_bandwidth,
            spec.gemm_efficiency,
            spec.attention_fwd_efficiency,
            spec.attention_bwd_efficiency,
            *spec.gemm_reference,
            *(n for t in spec.tiles for n in t),
        )
        zero_or_more = (spec.k_prologue, spec.host_forward_s, spec.host_backward_s)
        norm = spec.norm_memory_efficiency
        if min(positive) <= 0 or min(zero_or_more) < 0 or not spec.tiles or (norm is not None and norm <= 0):
            raise AutoplanError(
                f"{where}: device.kernels fields must be positive (k_prologue and the host_*_s may be 0)"
            )
        return spec


def _ints(values: Sequence[Any], count: int) -> tuple[int, ...]:
    if len(values) != count:
        raise ValueError(f"expected {count} numbers, got {list(values)}")
    return tuple(int(value) for value in values)


class GemmShape(NamedTuple):
    batch: int
    m: int
    n: int
    k: int

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k


def num_tiles(shape: GemmShape, tile: tuple[int, int]) -> int:
    return shape.batch * math.ceil(shape.m / tile[0]) * math.ceil(shape.n / tile[1])


def num_waves(tiles: int, num_sms: int) -> int:
    return math.ceil(tiles / num_sms)


def tile_efficiency(spec: KernelSpec, tile: tuple[int, int], *, peak: float) -> float:
    """Share of peak a tile keeps when fed from L2: ``min(1, l2_bandwidth · intensity / peak)``."""
    intensity = tile[0] * tile[1] / (tile[0] + tile[1])  # FLOPs per byte of 2-byte operands per K step
    return min(1.0, spec.l2_bandwidth * intensity / peak)


def kernel_s(spec: KernelSpec, shape: GemmShape, *, peak: float) -> float:
    """Seconds of ``shape`` at full peak per busy SM, on the fastest tile (before ``gemm_efficiency``)."""
    best = math.inf
    for tile in spec.tiles:
        waves = num_waves(num_tiles(shape, tile), spec.num_sms)
        per_sm = peak * tile_efficiency(spec, tile, peak=peak) / spec.num_sms
        best = min(best, waves * 2.0 * tile[0] * tile[1] * (shape.k + spec.k_prologue) / per_sm)
    return best


@lru_cache(maxsize=65536)
def shape_factor(spec: KernelSpec, shape: GemmShape, peak: float) -> float:
    """``flops / (peak · kernel_s)``: 1 for a shape that fills every wave with large-K full tiles."""
    return shape.flops / (peak * kernel_s(spec, shape, peak=peak))


def gemm_efficiency(spec: KernelSpec, shape: GemmShape, *, peak: float) -> float:
    """Fraction of ``peak`` the GEMM ``shape`` runs at: ``gemm_efficiency · f(shape) / f(reference)``."""
    m, n, k = spec.gemm_reference
    reference = shape_factor(spec, GemmShape(1, m, n, k), peak)
    return spec.gemm_efficiency * shape_factor(spec, shape, peak) / reference


def gemm_s(spec: KernelSpec, shape: GemmShape, *, peak: float) -> float:
    return shape.flops / (peak * gemm_efficiency(spec, shape, peak=peak)) if shape.flops > 0 else 0.0


def backward_shapes(shape: GemmShape) -> tuple[GemmShape, GemmShape]:
    """``dX = dY·Wᵀ`` (M×K outputs, inner N) and ``dW = Xᵀ·dY`` (K×N outputs, inner M)."""
    batch, m, n, k = shape
    return GemmShape(batch, m, k, n), GemmShape(batch, k, n, m)


def matmul_shape(node: OpNode, *, output_shape: Sequence[int], flops: float) -> GemmShape | None:
    """The GEMM a matmul node runs, from its (local) output shape and FLOPs: ``N`` the output's last dim,
    ``K = flops / (2 · outputs)``; the leading dims are rows of one GEMM when an operand is a 2-D matrix
    (linear, mm, a 3-D × 2-D matmul), else batch dims of ``M×N`` GEMMs (bmm, batched matmul). None when
    the node is not a GEMM (vector products, no FLOPs)."""
    outputs = math.prod(output_shape)
    if len(output_shape) < 2 or outputs == 0 or flops <= 0:
        return None
    k = max(1, round(flops / (2.0 * outputs)))
    n = output_shape[-1]
    operands = [meta for meta in node.input_metas if len(meta.shape) >= 2]
    if len(output_shape) == 2 or any(len(meta.shape) == 2 for meta in operands):
        return GemmShape(1, outputs // n, n, k)
    return GemmShape(math.prod(output_shape[:-2]), output_shape[-2], n, k)


_CAUSAL_POSITION = {
    "scaled_dot_product_attention": 5,
    "_scaled_dot_product_flash_attention": 4,
    "_scaled_dot_product_efficient_attention": 6,
    "_scaled_dot_product_flash_attention_for_cpu": 4,
    "_scaled_dot_product_cudnn_attention": 6,
}


def is_causal(node: OpNode) -> bool:
    """The attention node's ``is_causal`` argument (keyword or positional, per ATen signature)."""
    kwargs = dict(node.kwargs)
    if "is_causal" in kwargs:
        return bool(kwargs["is_causal"])
    position = _CAUSAL_POSITION.get(node.op_name)
    return position is not None and len(node.args) > position and node.args[position] is True


def attention_flops(node: OpNode, *, flops_fwd: float) -> tuple[float, float]:
    """Forward and backward FLOPs a fused attention kernel does: ``flops_fwd`` (full ``Sq·Sk``, as counted at
    capture) halved when causal, and 2.5 times that backward (FlashAttention's benchmark accounting)."""
    work = flops_fwd * (0.5 if is_causal(node) else 1.0)
    return work, 2.5 * work


def local_output_shape(meta: TensorMeta, output_shards: Mapping[int, int]) -> tuple[int, ...]:
    """``meta``'s shape with each dim divided by its shard count."""
    return tuple(size // output_shards.get(dim, 1) for dim, size in enumerate(meta.shape))
