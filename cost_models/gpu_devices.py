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
"""

from __future__ import annotations

from dataclasses import replace

from cost_models.device import DeviceSpec
from cost_models.gemm_efficiency import KernelSpec
from cost_models.units import GIB

_A100_L2 = 5120 * 1410e6  # bytes/clk x boost clock

V100_KERNELS = KernelSpec(
    num_sms=80,
    l2_bandwidth=2048 * 1530e6,
    k_prologue=32,
    gemm_efficiency=83 / 125,
    gemm_reference=(8192, 8192, 8192),
    attention_fwd_efficiency=round(83 / 125 * 0.60 / (271.2 / 312), 2),
    attention_bwd_efficiency=round(83 / 125 * 0.45 / (271.2 / 312), 2),
)
A100_KERNELS = KernelSpec(
    num_sms=108,
    l2_bandwidth=_A100_L2,
    k_prologue=128,
    gemm_efficiency=271.2 / 312,
    gemm_reference=(1024, 10240, 5120),
    attention_fwd_efficiency=0.60,
    attention_bwd_efficiency=0.45,
)
H100_KERNELS = KernelSpec(
    num_sms=132,
    l2_bandwidth=_A100_L2 / 108 / 1410e6 * 132 * 1830e6,
    k_prologue=128,
    gemm_efficiency=794.5 / 989,
    gemm_reference=(2048, 2048, 13312),
    attention_fwd_efficiency=0.35,
    attention_bwd_efficiency=round(0.35 * 0.45 / 0.60, 2),
)

_V100_PEAKS = {"float16": 125e12, "bfloat16": 125e12, "float32": 15.7e12}

# p3.16xlarge: V100 SXM2 16 GB, 125 TFLOP/s fp16, 900 GB/s HBM2.
V100_16GB = DeviceSpec(
    name="V100-SXM2-16GB",
    peak_flops=_V100_PEAKS,
    memory_bytes=16 * GIB,
    memory_bandwidth=900e9,
    memory_efficiency=0.83,
    kernels=V100_KERNELS,
)
# DGX-2H: V100 SXM3 32 GB (Megatron-LM 2019; published-measurements.md: 125 TFLOP/s fp16 as the paper counts).
V100_32GB = replace(V100_16GB, name="V100-SXM3-32GB", memory_bytes=32 * GIB)
A100_80GB = DeviceSpec(
    name="A100-SXM-80GB",
    peak_flops={"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
    memory_bytes=80 * GIB,
    memory_bandwidth=2.039e12,
    memory_efficiency=0.88,
    kernels=A100_KERNELS,
)
H100_80GB = DeviceSpec(
    name="H100-SXM-80GB",
    peak_flops={"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    memory_bytes=80 * GIB,
    memory_bandwidth=3.35e12,
    memory_efficiency=0.90,
    kernels=H100_KERNELS,
)
