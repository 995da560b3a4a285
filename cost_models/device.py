"""One device of a cluster: :class:`DeviceSpec` (re-exported by :mod:`cost_models.cluster`).

A GPU preset carries a :class:`~cost_models.gemm_efficiency.KernelSpec` (``kernels``): the compute
model then prices matmuls and attention by their shapes (:mod:`cost_models.gemm_efficiency`). A device
without one (CPU processes, calibrated clusters, cluster files that give none) keeps the flat roofline:
every FLOP at ``peak · compute_efficiency``.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.gemm_efficiency import KernelSpec


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or CPU process): peak FLOP/s per dtype, memory, efficiencies."""

    name: str
    peak_flops: dict[str, float]
    memory_bytes: int
    memory_bandwidth: float
    # Share of peak of compute-bound operators the shape model does not cover (and of every one without it).
    compute_efficiency: float = 0.6
    # Share of ``memory_bandwidth`` memory-bound operators reach (the GPU presets: measured, see gpu_devices.py).
    memory_efficiency: float = 0.8
    kernel_overhead_s: float = 5e-6
    mixed_precision: bool = True
    # Host-side runtime overheads of our executors (0 on the presets; ``plan calibrate`` fits them, see
    # calibration/runtime_fit.py): per operator per pass on a multi-device stage (DTensor dispatch and
    # redistribution checks), and per pipeline stage per microbatch (schedule actions, P2P bookkeeping).
    sharded_op_overhead_s: float = 0.0
    microbatch_overhead_s: float = 0.0
    step_overhead_s: float = 0.0  # once per training step (optimizer launch, zeroing, process sync)
    # How much slower one process computes while all the cluster's processes run than alone (1 on the presets;
    # ``plan calibrate`` measures it): operator times profiled by one process alone are multiplied by it.
    shared_slowdown: float = 1.0
    # Bytes per device the plan may not use (None: the default for the device kind, see reserved_bytes).
    memory_reserve_bytes: int | None = None
    # What ``plan tune`` measured a plan's memory estimate to miss by (cost_models/corrections.py): the budget a
    # plan may use is divided by it (1: nothing learned).
    memory_correction: float = 1.0
    # The GPU's kernel shape model (None: the flat roofline).
    kernels: KernelSpec | None = None

    def is_cpu(self) -> bool:
        return self.name.startswith("cpu")

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``; the training dtype (bf16 or fp32) when unknown."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        return self.peak_flops["bfloat16" if self.mixed_precision else "float32"]


RUNTIME_FIELDS = ("sharded_op_overhead_s", "microbatch_overhead_s", "step_overhead_s")
