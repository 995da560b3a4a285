"""One device of a cluster: :class:`DeviceSpec` (re-exported by :mod:`cost_models.cluster`).

A GPU preset carries a :class:`~cost_models.gemm_efficiency.KernelSpec` (``kernels``): the compute
model then prices matmuls and attention by their shapes (:mod:`cost_models.gemm_efficiency`). A device
without one (CPU processes, calibrated clusters, cluster files that give none) keeps the flat roofline:
every FLOP at ``peak · compute_efficiency``.

**The host** (:class:`HostLink`, :func:`host_link`). The link between a device and its host, and the host memory a
CPU optimizer step streams: what CPU offload costs.

FSDP2's ``CPUOffloadPolicy`` keeps each device's shards of the parameters, gradients and optimizer state in host
memory: every all-gather first copies the parameter shard host-to-device, every reduce-scatter's gradient shard is
copied device-to-host, and the optimizer steps on the CPU (:mod:`planner.costing.offload` prices it). Two figures
per device kind, :class:`HostLink`:

* ``bandwidth``: one direction of the device's PCIe link as a pinned ``cudaMemcpyAsync`` reaches it (the
  ``bandwidthTest`` figure), bytes/s. PCIe x16 carries 15.75 GB/s per direction at 3.0, 31.5 at 4.0 and 63 at 5.0
  (PCI-SIG specifications: 8, 16 and 32 GT/s per lane, 128b/130b encoding); pinned copies are taken at 80% of
  it, the share the CUDA samples' ``bandwidthTest`` commonly shows for pinned memory (about 12 GB/s on PCIe 3.0
  x16; TLP headers and flow control take the rest): a judgement figure, not measured here. V100 on p3.16xlarge and
  DGX-2H: PCIe 3.0, 12.6 GB/s; A100 on DGX A100: PCIe 4.0, 25.2 GB/s; H100 on DGX H100: PCIe 5.0, 50.4 GB/s. Each
  GPU is taken to have its link to itself (DGX nodes pair two GPUs under one switch whose x16 uplink they share:
  the copies of a node may take up to twice as long when both GPUs of a pair copy at once; not modelled).
* ``host_memory_bandwidth``: the node's DRAM bandwidth as STREAM reaches it, bytes/s, shared by its devices'
  optimizer steps (:meth:`HostLink.per_device_memory_bandwidth`). Channels × transfer rate × 8 bytes × sockets
  (the CPUs' data sheets), at the 75% STREAM triad reaches on server CPUs (J. McCalpin, STREAM results): p3.16xlarge
  2 × Xeon E5-2686 v4, 4 DDR4-2400 channels each, 153.6 GB/s peak; DGX-2H 2 × Xeon Platinum 8174, 6 DDR4-2666
  channels, 256 GB/s; DGX A100 2 × EPYC 7742, 8 DDR4-3200 channels, 409.6 GB/s; DGX H100 2 × Xeon Platinum 8480C,
  8 DDR5-4800 channels, 614.4 GB/s.

* ``host_memory_bytes``: the node's DRAM, which holds every device's offloaded shards: p3.16xlarge 488 GiB (AWS EC2
  instance types page), DGX-2H 1.5 TB, DGX A100 1 TB, DGX H100 2 TB (NVIDIA's DGX data sheets).

A CPU process (``local-cpu``, calibrated clusters) is its own host: a "copy" is a memcpy within its memory
(reading and writing: half the device's streaming bandwidth) and the step streams at the device's own bandwidth.
Another device (a cluster file's) is taken as PCIe 4.0 with the DGX A100 host, an assumption stated here.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.gemm_efficiency import KernelSpec
from cost_models.units import GIB


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

PINNED_PCIE_SHARE = 0.8  # pinned cudaMemcpyAsync against the link's line rate (module docstring)
STREAM_SHARE = 0.75  # STREAM triad against the DRAM channels' peak (module docstring)
PCIE_X16 = {3: 15.75e9, 4: 31.5e9, 5: 63e9}  # bytes/s per direction


def _dram(*, sockets: int, channels: int, megatransfers: int) -> float:
    """Peak DRAM bandwidth of a node, bytes/s: channels × transfers/s × 8 bytes × sockets."""
    return sockets * channels * megatransfers * 1e6 * 8


@dataclass(frozen=True, kw_only=True)
class HostLink:
    """A device's PCIe link to its host (one direction, bytes/s) and its node's host memory bandwidth."""

    bandwidth: float
    host_memory_bandwidth: float
    host_memory_bytes: float  # the node's DRAM, shared by its devices' offloaded shards
    devices_per_host: int = 1  # the devices whose optimizer steps and offloaded shards share the host memory

    def copy_s(self, num_bytes: float) -> float:
        """Seconds to copy ``num_bytes`` between the device and its host, one direction."""
        return num_bytes / self.bandwidth if num_bytes else 0.0

    @property
    def per_device_memory_bandwidth(self) -> float:
        """The host memory bandwidth one device's CPU optimizer step gets while every device of the node steps."""
        return self.host_memory_bandwidth / self.devices_per_host


# device name -> (PCIe generation, the node's DRAM peak bandwidth, the node's DRAM): the module docstring's table
_GPU_HOSTS = {
    "V100-SXM2-16GB": (3, _dram(sockets=2, channels=4, megatransfers=2400), 488 * GIB),
    "V100-SXM3-32GB": (3, _dram(sockets=2, channels=6, megatransfers=2666), 1.5e12),
    "A100-SXM-80GB": (4, _dram(sockets=2, channels=8, megatransfers=3200), 1e12),
    "H100-SXM-80GB": (5, _dram(sockets=2, channels=8, megatransfers=4800), 2e12),
}
_OTHER_GPU_HOST = _GPU_HOSTS["A100-SXM-80GB"]


def host_link(device: DeviceSpec, *, devices_per_node: int) -> HostLink:
    """The host link of ``device`` on a node of ``devices_per_node`` devices (module docstring). A CPU process's
    host is its own memory (offload moves nothing off it)."""
    if device.is_cpu():
        streaming = device.memory_bandwidth * device.memory_efficiency
        return HostLink(bandwidth=streaming / 2, host_memory_bandwidth=streaming, host_memory_bytes=device.memory_bytes)
    generation, bandwidth, memory = _GPU_HOSTS.get(device.name, _OTHER_GPU_HOST)
    return HostLink(
        bandwidth=PINNED_PCIE_SHARE * PCIE_X16[generation],
        host_memory_bandwidth=STREAM_SHARE * bandwidth,
        host_memory_bytes=memory,
        devices_per_host=devices_per_node,
    )
