"""The GPUs of the cluster presets, each figure set once from a data sheet or a published measurement.

Peak FLOP/s, memory and HBM bandwidth: REFERENCES.md's hardware table (NVIDIA data sheets); fp32 peaks
are the data sheets' too. ``memory_efficiency`` is the share of the data-sheet bandwidth a streaming
kernel reaches (STREAM-like microbenchmarks), so memory-bound operators run at achievable, not peak,
bandwidth. The kernel shape model (:class:`~cost_models.gemm_efficiency.KernelSpec`, see that module):

* ``num_sms``: the architecture whitepapers (V100 80, A100 108, H100 SXM5 132).
* ``l2_bandwidth``: NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020), "L2 cache read bandwidth"
  5120 bytes/clk on A100 against 2048 bytes/clk on V100, at the boost clocks behind the peak FLOP/s
  (1410 MHz, 1530 MHz). H100: no per-clock figure is published; A100's per-SM figure scaled to 132 SMs at
  1830 MHz (the clock behind 989 TFLOP/s) — an estimate, stated as one.
* ``k_prologue``: the K slices a cuBLAS main loop loads before its first multiply, ``(stages − 1) · k_slice``:
  Ampere kernels are ``stages_64x3`` / ``stages_32x5`` (kernel names, e.g. ampere_fp16_s16816gemm_fp16_
  256x128_ldg8_f2f_stages_64x3_nn): 128; Volta kernels double-buffer 32-wide slices (CUTLASS's default
  Sm70 tensor-op configuration, 2 stages of K = 32): 32. Hopper: taken as Ampere's.
* ``gemm_efficiency`` at ``gemm_reference``: the maximum achievable matmul FLOP/s (bf16, best shape of a
  shape search) of S. Bekman, "Machine Learning Engineering", compute/accelerator, MAMF table: A100 SXM
  271.2 of 312 TFLOP/s at 1024×10240×5120; H100 SXM 794.5 of 989 at 2048×2048×13312. V100: S. Markidis et al.,
  "NVIDIA Tensor Core Programmability, Performance & Precision" (IPDPSW 2018): cuBLAS mixed-precision GEMM
  up to 83 TFLOP/s of 125, on their largest square matrices (8192 taken as the shape).
* attention: T. Dao, "FlashAttention-2" (2023): 50–73% of A100 peak forward, the backward pass below the
  forward; we take 0.60 forward and 0.45 backward. H100 runs FlashAttention-2 under PyTorch's SDPA, which
  "achieves only 35% utilization on H100" (J. Shah et al., "FlashAttention-3", 2024): 0.35 forward, the
  backward at A100's backward/forward ratio (0.26). V100 has no FlashAttention (SDPA runs the
  memory-efficient kernel); no published utilisation was found, so it is taken at the same fraction of
  the device's GEMM rate as FlashAttention-2 on A100 (0.46, 0.34) — an assumption, stated as one.
* ``memory_efficiency``: A100 80 GB: 1.80 of 2.04 TB/s measured by a streaming read kernel, 88% in Nsight
  Compute (NVIDIA developer forum, "Trouble to reach peak bandwidth of A100", 2025, which also quotes a GTC
  talk: no kernel beyond about 90%); V100: 750 of 900 GB/s (Z. Jia et al., "Dissecting the NVIDIA Volta GPU
  Architecture via Microbenchmarking", 2018), 0.83; H100: 0.90, the GTC figure (no H100-specific one found).
* ``norm_memory_efficiency``: PyTorch's LayerNorm, forward and backward, on A100 in fp16 (pytorch/pytorch PR
  #87445, "Layer norm backward speed gain with warp shuffles", its table after the change): 8192×4096 in 509 µs.
  Counted as the cost model counts a norm's bytes (2 B per element read and written forward, twice that
  backward: 12 B per element over both), that is 402.7 MB in 509 µs, 0.39 of the data sheet's 2.039 TB/s (the
  LayerNorm backward's second kernel, the weight and bias gradients' column reduction, streams far below a copy).
  V100 and H100: no such measurement found; the same fraction of their streaming efficiency as on A100
  (0.39 / 0.88), an assumption, stated as one.
* ``kernel_overhead_s`` (on the device, :mod:`cost_models.device`): the gap a kernel costs on the GPU's
  timeline beyond its work when the host keeps the queue full: A. Gray, "Getting Started with CUDA Graphs"
  (NVIDIA developer blog, 2019), V100: 2.9-µs kernels run at 3.8 µs each when launched back to back without
  synchronizing, 0.9 µs per kernel: taken as 1 µs on every GPU preset.
* ``host_forward_s``, ``host_backward_s``: eager PyTorch's host time per operator call, measured by
  ``benchmarks/dispatch_overhead.py`` (``benchmarks/results/dispatch_overhead-2026-11-26.md``: the fastest of 100
  runs on this project's CPU machine, torch 2.13, a transformer layer's operators on one-row tensors, 5.95 and
  10.01 µs): 6 µs forward, 10 µs backward (its autograd node). The CUDA launch call is not in the
  measurement, so on a GPU host each call costs more: a lower bound. Set before, and independently of, the
  published runs they are scored on.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from cost_models.device import DeviceSpec
from cost_models.gemm_efficiency import KernelSpec
from cost_models.units import GIB

_A100_L2 = 5120 * 1410e6  # bytes/clk x boost clock
_HOST = {"host_forward_s": 6e-6, "host_backward_s": 10e-6}  # benchmarks/dispatch_overhead.py, see above
_NORM_SHARE = 402.7e6 / 509e-6 / 2.039e12 / 0.88  # A100's LayerNorm share of its streaming efficiency (above)
_GAP_S = 1e-6  # kernel_overhead_s: the gap between back-to-back kernels (above)

V100_KERNELS = KernelSpec(
    num_sms=80,
    l2_bandwidth=2048 * 1530e6,
    k_prologue=32,
    gemm_efficiency=83 / 125,
    gemm_reference=(8192, 8192, 8192),
    attention_fwd_efficiency=round(83 / 125 * 0.60 / (271.2 / 312), 2),
    attention_bwd_efficiency=round(83 / 125 * 0.45 / (271.2 / 312), 2),
    norm_memory_efficiency=round(0.83 * _NORM_SHARE, 2),
    **_HOST,
)
A100_KERNELS = KernelSpec(
    num_sms=108,
    l2_bandwidth=_A100_L2,
    k_prologue=128,
    gemm_efficiency=271.2 / 312,
    gemm_reference=(1024, 10240, 5120),
    attention_fwd_efficiency=0.60,
    attention_bwd_efficiency=0.45,
    norm_memory_efficiency=round(0.88 * _NORM_SHARE, 2),
    **_HOST,
)
H100_KERNELS = KernelSpec(
    num_sms=132,
    l2_bandwidth=_A100_L2 / 108 / 1410e6 * 132 * 1830e6,
    k_prologue=128,
    gemm_efficiency=794.5 / 989,
    gemm_reference=(2048, 2048, 13312),
    attention_fwd_efficiency=0.35,
    attention_bwd_efficiency=round(0.35 * 0.45 / 0.60, 2),
    norm_memory_efficiency=round(0.90 * _NORM_SHARE, 2),
    **_HOST,
)


class _DataSheet(NamedTuple):
    """A GPU preset's figures, one table row each (module docstring): the tensor cores' peak FLOP/s (the same
    for bf16 and fp16), the fp32 peak, memory, HBM bandwidth, the share of it a streaming kernel reaches, and the
    kernel shape model. Every preset has the same gap between back-to-back kernels (``_GAP_S``)."""

    name: str
    half_precision_peak: float
    fp32_peak: float
    memory_gib: int
    memory_bandwidth: float
    memory_efficiency: float
    kernels: KernelSpec

    def device(self) -> DeviceSpec:
        peak = self.half_precision_peak
        return DeviceSpec(
            name=self.name,
            peak_flops={"bfloat16": peak, "float16": peak, "float32": self.fp32_peak},
            memory_bytes=self.memory_gib * GIB,
            memory_bandwidth=self.memory_bandwidth,
            memory_efficiency=self.memory_efficiency,
            kernel_overhead_s=_GAP_S,
            kernels=self.kernels,
        )


# Each row: name, bf16/fp16 and fp32 peak FLOP/s, memory (GiB), HBM bandwidth (B/s), streaming share, kernels.
# V100: p3.16xlarge's V100 SXM2 16 GB, 125 TFLOP/s fp16, 900 GB/s HBM2.
V100_16GB = _DataSheet("V100-SXM2-16GB", 125e12, 15.7e12, 16, 900e9, 0.83, V100_KERNELS).device()
A100_80GB = _DataSheet("A100-SXM-80GB", 312e12, 19.5e12, 80, 2.039e12, 0.88, A100_KERNELS).device()
H100_80GB = _DataSheet("H100-SXM-80GB", 989e12, 67e12, 80, 3.35e12, 0.90, H100_KERNELS).device()
# DGX-2H: V100 SXM3 32 GB (Megatron-LM 2019; published-measurements.md: 125 TFLOP/s fp16 as the paper counts).
V100_32GB = replace(V100_16GB, name="V100-SXM3-32GB", memory_bytes=32 * GIB)
