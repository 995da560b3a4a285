"""Clusters: devices, links, presets, and the cluster file format.

A :class:`Cluster` is ``num_nodes`` nodes of ``devices_per_node`` identical devices. Devices
inside a node talk over ``intra_node``; devices on different nodes over ``inter_node``. Global
rank ``r`` lives on node ``r // devices_per_node``. Bandwidths are bytes per second in one
direction per device; latencies are seconds per message (the α of the α-β model).

Presets take their figures from REFERENCES.md (hardware table and measured NCCL numbers);
``local-cpu`` describes this machine's processes before ``plan calibrate`` measures it.
A cluster file (TOML or JSON) has the fields of :meth:`Cluster.to_json` (its device section:
:mod:`cost_models.device_file`); ``plan calibrate`` writes one.

Not all of a device's memory is the plan's: :func:`reserved_bytes` is what the runtime takes
first (the CUDA context, library workspaces, NCCL buffers and the allocator's fragmentation on a
GPU; the interpreter and torch's libraries in a CPU process), and :func:`memory_budget_bytes` is
what is left times ``--memory-fraction``: the budget every search plans under.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cost_models.device import DeviceSpec, HostLink, host_link
from cost_models.device_file import check_peak_flops, device_json, number, parse_device
from cost_models.gpu_devices import A100_80GB, H100_80GB, V100_16GB, V100_32GB
from cost_models.units import GIB
from planner.errors import AutoplanError

# The default reserve of a GPU: a fixed part plus a share of its capacity. Judgement figures, not measurements:
# * fixed, 1 GiB: the CUDA context with PyTorch's kernels loaded (commonly 0.3-1 GiB; it is not counted by
#   torch.cuda.memory_allocated, PyTorch docs "CUDA semantics" > "Memory management"), cuBLAS/cuBLASLt
#   workspaces (4 MiB per handle and stream on Ampere, 32 MiB on Hopper: cuBLAS docs, cublasSetWorkspace;
#   pytorch/pytorch#120925) and NCCL's buffers (NCCL_BUFFSIZE, default 4 MiB, per channel and peer of each
#   communicator: NCCL User Guide, "Environment Variables"; 4 MiB x 32 channels x send/recv is 256 MiB a
#   communicator, and a plan may open one per mesh axis);
# * 8% of capacity: fragmentation in PyTorch's caching allocator, the memory it has reserved from CUDA but
#   cannot hand out (memory_reserved - memory_allocated; PyTorch docs "CUDA semantics" > "Optimizing memory
#   usage with PYTORCH_CUDA_ALLOC_CONF"), commonly 5-10% in large-model training.
GPU_FIXED_RESERVE_BYTES = 1 * GIB
GPU_FRAGMENTATION_SHARE = 0.08
# The default reserve of a CPU process (device names starting with "cpu": local-cpu, calibrated clusters): the
# Python interpreter and torch's libraries, which the executors' processes hold besides the plan's tensors.
# Measured on the development machine (Python 3.11, torch 2.13, Linux): 0.22 GiB peak RSS after importing torch
# and one forward/backward, 0.31 GiB with torch.distributed (gloo), DTensor and the executors imported; rounded
# up to 0.5 GiB. No fragmentation share: CPU tensors come from the system allocator, not a caching one.
CPU_RESERVE_BYTES = GIB // 2


@dataclass(frozen=True, kw_only=True)
class Link:
    """A link between two devices: bandwidth in bytes/s (one direction), latency in s."""

    bandwidth: float
    latency_s: float

    def transfer_s(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth


@dataclass(frozen=True, kw_only=True)
class GroupLink(Link):
    """The link of a device group that spans ``num_nodes`` nodes (its bandwidth and latency: the inter-node link
    as the group sees it), with the ``intra_node`` link its devices on one node share and the ``backend`` that
    runs its collectives ("nccl" on GPUs, "gloo" on CPU processes): what the all-reduce algorithms beyond a ring
    need (:mod:`cost_models.collective_algorithms`)."""

    num_nodes: int
    intra_node: Link
    backend: str = "nccl"


@dataclass(frozen=True, kw_only=True)
class Cluster:
    name: str
    num_nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: Link
    inter_node: Link
    # Network interfaces per node that carry ``inter_node`` traffic (None: one per device, as on DGX nodes).
    # Concurrent cross-node flows from one node share them (:meth:`shared_inter_node`).
    nics_per_node: int | None = None
    source: str = field(default="preset", compare=False)
    # Where the figures come from when they were measured here: {"by": "plan calibrate" | "plan tune", "date":
    # ..., "host": ..., "corrections": {...}} (None: data-sheet figures of a preset or a hand-written file).
    calibration: Mapping[str, Any] | None = field(default=None, compare=False)

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def link_between(self, ranks: tuple[int, ...] | list[int]) -> Link:
        """The slowest link a group of ranks needs: inter-node as soon as it spans nodes (then a
        :class:`GroupLink`, :meth:`spanning`)."""
        nodes = {self.node_of(rank) for rank in ranks}
        return self.spanning(self.inter_node, num_nodes=len(nodes)) if len(nodes) > 1 else self.intra_node

    def spanning(self, link: Link, *, num_nodes: int) -> Link:
        """``link`` as the link of a group on ``num_nodes`` nodes: a :class:`GroupLink` past one node."""
        if num_nodes <= 1:
            return link
        backend = "gloo" if self.device.is_cpu() else "nccl"
        return GroupLink(
            bandwidth=link.bandwidth,
            latency_s=link.latency_s,
            num_nodes=num_nodes,
            intra_node=self.intra_node,
            backend=backend,
        )

    def host(self) -> HostLink:
        """Each device's link to its host and the host's memory (:mod:`cost_models.device`: CPU offload)."""
        return host_link(self.device, devices_per_node=self.devices_per_node)

    def shared_inter_node(self, *, flows_per_node: int) -> Link:
        """The inter-node link as each of ``flows_per_node`` concurrent cross-node flows leaving (or entering)
        one node sees it: the node's NICs are shared, so past one flow per NIC each gets its share."""
        nics = self.devices_per_node if self.nics_per_node is None else self.nics_per_node
        share = min(1.0, nics / max(flows_per_node, 1))
        return Link(bandwidth=self.inter_node.bandwidth * share, latency_s=self.inter_node.latency_s)

    def with_shape(self, *, num_nodes: int | None = None, devices_per_node: int | None = None) -> Cluster:
        """This cluster with ``--nodes`` / ``--devices-per-node`` overrides applied."""
        for flag, value in (("--nodes", num_nodes), ("--devices-per-node", devices_per_node)):
            if value is not None and value <= 0:
                raise AutoplanError(f"{flag} must be a positive number of devices, got {value}")
        return replace(
            self,
            num_nodes=num_nodes if num_nodes is not None else self.num_nodes,
            devices_per_node=devices_per_node if devices_per_node is not None else self.devices_per_node,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_nodes": self.num_nodes,
            "devices_per_node": self.devices_per_node,
            "device": device_json(self.device),
            "intra_node": {"bandwidth": self.intra_node.bandwidth, "latency_s": self.intra_node.latency_s},
            "inter_node": {"bandwidth": self.inter_node.bandwidth, "latency_s": self.inter_node.latency_s},
            **({} if self.nics_per_node is None else {"nics_per_node": self.nics_per_node}),
            **({} if self.calibration is None else {"calibration": dict(self.calibration)}),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], *, source: str = "file") -> Cluster:
        """Build from a parsed cluster file; a missing or wrong field is an AutoplanError."""
        return _parse_cluster(data, source=source)


def reserved_bytes(device: DeviceSpec) -> int:
    """Bytes of each device the plan may not use: the device's own ``memory_reserve_bytes`` when set
    (a cluster file may), else :data:`CPU_RESERVE_BYTES` for a CPU process and
    :data:`GPU_FIXED_RESERVE_BYTES` + :data:`GPU_FRAGMENTATION_SHARE` of capacity for any other device."""
    if device.memory_reserve_bytes is not None:
        return device.memory_reserve_bytes
    if device.is_cpu():
        return CPU_RESERVE_BYTES
    return GPU_FIXED_RESERVE_BYTES + int(GPU_FRAGMENTATION_SHARE * device.memory_bytes)


def usable_memory_bytes(device: DeviceSpec) -> int:
    """Capacity less the reserve (never below 0)."""
    return max(device.memory_bytes - reserved_bytes(device), 0)


def memory_budget_bytes(cluster: Cluster, *, memory_fraction: float = 1.0) -> float:
    """Bytes per device a plan may use: (capacity - reserve) x ``memory_fraction`` / the memory correction
    ``plan tune`` learned (:mod:`cost_models.corrections`; 1 without one)."""
    return usable_memory_bytes(cluster.device) * memory_fraction / cluster.device.memory_correction


def reserve_reason(device: DeviceSpec) -> str:
    """Why ``device`` keeps its reserve, as the messages say it."""
    if device.memory_reserve_bytes is not None:
        return "by the cluster's memory_reserve_bytes"
    if device.is_cpu():
        return "for the Python interpreter and torch libraries"
    return "for CUDA context, NCCL buffers and allocator fragmentation"


def describe_memory_budget(cluster: Cluster, *, memory_fraction: float = 1.0) -> str:
    """``72.6 GiB (80.0 GiB less 7.4 GiB reserved for CUDA context, NCCL buffers and allocator fragmentation)``;
    below fraction 1: ``36.3 GiB (memory fraction 0.5 of 72.6 GiB: 80.0 GiB less 7.4 GiB reserved for ...)``."""
    device = cluster.device
    budget = memory_budget_bytes(cluster, memory_fraction=memory_fraction)
    usable = usable_memory_bytes(device)
    share = "" if memory_fraction == 1.0 else f"memory fraction {memory_fraction:g} of {usable / GIB:.1f} GiB: "
    reserve = reserved_bytes(device)
    return (
        f"{budget / GIB:.1f} GiB ({share}{device.memory_bytes / GIB:.1f} GiB less {reserve / GIB:.1f} GiB "
        f"reserved {reserve_reason(device)})"
    )


def _local_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 * GIB


def _local_cpu() -> Cluster:
    num_devices = max(os.cpu_count() or 1, 1)
    return Cluster(
        name="local-cpu",
        num_nodes=1,
        devices_per_node=num_devices,
        # Rough figures for one CPU core per process, before `plan calibrate` measures them.
        device=DeviceSpec(
            name="cpu",
            peak_flops={"float32": 1.0e11, "bfloat16": 1.0e11, "float16": 1.0e11},
            memory_bytes=_local_memory_bytes() // num_devices,
            memory_bandwidth=1.0e10,
            compute_efficiency=0.5,
            memory_efficiency=0.5,
            kernel_overhead_s=2e-5,
            mixed_precision=False,
        ),
        intra_node=Link(bandwidth=2.0e9, latency_s=5e-5),
        inter_node=Link(bandwidth=1.25e9, latency_s=1e-4),
    )


def _gpu_cluster(
    name: str,
    device: DeviceSpec,
    intra_node: Link,
    inter_node: Link,
    *,
    devices_per_node: int = 8,
    nics_per_node: int | None = None,
) -> Cluster:
    return Cluster(
        name=name,
        num_nodes=1,
        devices_per_node=devices_per_node,
        device=device,
        intra_node=intra_node,
        inter_node=inter_node,
        nics_per_node=nics_per_node,
    )


# The devices (peaks, memory, bandwidths, kernel shape models) and their sources: cost_models/gpu_devices.py.
_V100, _V100_32, _A100, _H100 = V100_16GB, V100_32GB, A100_80GB, H100_80GB


def _presets() -> dict[str, Cluster]:
    return {
        "local-cpu": _local_cpu(),
        "p3.16xlarge": _gpu_cluster(
            "p3.16xlarge",
            _V100,
            Link(bandwidth=150e9, latency_s=10e-6),  # NVLink 300 GB/s bidirectional; ~10 µs on 2 GPUs
            Link(bandwidth=25e9 / 8, latency_s=20e-6),  # 25 Gbit/s per node
            nics_per_node=1,  # one 25 Gbit/s ENA interface per p3.16xlarge (AWS EC2 instance types page)
        ),
        # Megatron-LM 2019's DGX-2H (published-measurements.md): 16 V100 32 GB per node on NVSwitch, 300 GB/s
        # bidirectional per GPU; 8 x 100 Gbit/s InfiniBand per node, two GPUs to a NIC, each NIC at ~90% of its
        # line rate as the dgx-a100 figure measures HDR (85-96 GB/s on 4 x 200 Gbit/s).
        "dgx-2h": _gpu_cluster(
            "dgx-2h",
            _V100_32,
            Link(bandwidth=150e9, latency_s=10e-6),  # NVSwitch 300 GB/s bidirectional; latency as p3.16xlarge's NVLink
            Link(bandwidth=0.9 * 100e9 / 8, latency_s=15e-6),  # one 100 Gbit/s EDR NIC, as its flows see it
            devices_per_node=16,
            nics_per_node=8,
        ),
        "dgx-a100": _gpu_cluster(
            "dgx-a100",
            _A100,
            Link(bandwidth=208e9, latency_s=5e-6),  # measured NCCL all-reduce busbw, 8 A100
            Link(bandwidth=23e9, latency_s=15e-6),  # 85-96 GB/s on 4 HDR -> ~23 GB/s per HDR NIC per GPU
        ),
        "dgx-h100": _gpu_cluster(
            "dgx-h100",
            _H100,
            Link(bandwidth=370e9, latency_s=5e-6),  # measured NCCL ring busbw, 8 H100
            Link(bandwidth=45e9, latency_s=15e-6),  # NDR 400 Gbit/s per GPU at ~90% efficiency
        ),
    }


PRESET_NAMES = ("local-cpu", "p3.16xlarge", "dgx-2h", "dgx-a100", "dgx-h100")


def preset(name: str) -> Cluster:
    presets = _presets()
    if name not in presets:
        raise AutoplanError(
            f"unknown cluster preset {name!r}: use one of {', '.join(PRESET_NAMES)} or a .toml/.json file"
        )
    return presets[name]


def load_cluster(name_or_path: str, *, num_nodes: int | None = None, devices_per_node: int | None = None) -> Cluster:
    """A preset by name, or a cluster file (TOML or JSON), with shape overrides."""
    path = Path(name_or_path)
    if name_or_path in PRESET_NAMES:
        cluster = preset(name_or_path)
    elif path.suffix in (".toml", ".json") or path.exists():
        cluster = _read_cluster_file(path)
    else:
        cluster = preset(name_or_path)
    return cluster.with_shape(num_nodes=num_nodes, devices_per_node=devices_per_node)


def _read_cluster_file(path: Path) -> Cluster:
    if not path.is_file():
        raise AutoplanError(f"cluster file {path} does not exist")
    text = path.read_text()
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
        raise AutoplanError(f"cluster file {path} is not valid {path.suffix.lstrip('.') or 'JSON'}: {error}") from None
    return _parse_cluster(data, source=str(path))


def _parse_cluster(data: Any, *, source: str) -> Cluster:
    where = f"cluster file {source}"
    if not isinstance(data, dict):
        raise AutoplanError(f"{where} must hold a table/object with fields num_nodes, devices_per_node, device, ...")
    device = _section(data, "device", where)
    check_peak_flops(device, where)
    cluster = Cluster(
        name=str(data.get("name", Path(source).stem)),
        num_nodes=number(data, "num_nodes", where, integer=True),
        devices_per_node=number(data, "devices_per_node", where, integer=True),
        device=parse_device(device, where),
        intra_node=_link(data, "intra_node", where),
        inter_node=_link(data, "inter_node", where),
        nics_per_node=number(data, "nics_per_node", where, integer=True) if "nics_per_node" in data else None,
        source=source,
        calibration=_calibration(data, where),
    )
    return cluster


CALIBRATION_SUMMARY = ("by", "date", "hostname", "torch_version", "num_processes", "corrections", "tuned_on")


def _calibration(data: dict, where: str) -> dict[str, Any] | None:
    """What says the figures were measured here (the summary fields of the file's ``calibration`` section: its
    samples and fits stay in the file)."""
    value = data.get("calibration")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise AutoplanError(f"{where}: calibration must be a table/object (what plan calibrate or plan tune wrote)")
    return {key: value[key] for key in CALIBRATION_SUMMARY if key in value}


def _section(data: dict, key: str, where: str) -> dict:
    value = data.get(key)
    if not isinstance(value, dict):
        raise AutoplanError(f"{where}: missing section [{key}]")
    return value


def _link(data: dict, key: str, where: str) -> Link:
    section = _section(data, key, where)
    return Link(
        bandwidth=number(section, "bandwidth", f"{where}: {key}"),
        latency_s=number(section, "latency_s", f"{where}: {key}", allow_zero=True),
    )
