"""The device ``benchmarks/gpu_check.py`` runs on: its cluster for the cost model, what the machine is, a timer.

:func:`cluster_for` turns the name CUDA reports (``torch.cuda.get_device_name()``) into the one-device
cluster every prediction of the check is priced on:

* an H100 is the ``dgx-h100`` preset's device (:data:`cost_models.gpu_devices.H100_80GB`);
* an H200 is the same GH100 chip (132 SMs, the same clocks and tensor cores, so the same peaks and kernel
  shape model) with HBM3e: NVIDIA H200 Tensor Core GPU data sheet (2024), H200 SXM: "GPU memory 141GB,
  GPU memory bandwidth 4.8TB/s", BF16 Tensor Core 1,979 TFLOPS *with sparsity* (989 dense, as H100 SXM).
  The streaming share of that bandwidth (``memory_efficiency``) is H100's 0.90, an assumption (no H200
  measurement found); memory is taken in GiB as the presets take "80GB";
* an A100 and a V100 are their presets' devices (``dgx-a100``, ``p3.16xlarge``); any other name is priced
  as an H100, and the note says so.

The check writes this cluster to a file (:func:`write_cluster`) and plans with ``--cluster FILE``, so the
plans and the operator predictions use one device. :class:`Timer` times a callable: CUDA events around
each call after a write that evicts the L2 cache, median of the repeats after warm-up; on CPU (the dry
run) the same loop with ``time.perf_counter``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from cost_models.cluster import Cluster, preset
from cost_models.gpu_devices import H100_80GB
from cost_models.units import GIB

H200_141GB = replace(H100_80GB, name="H200-SXM-141GB", memory_bytes=141 * GIB, memory_bandwidth=4.8e12)
L2_FLUSH_BYTES = 256 * 2**20  # larger than any L2 of these GPUs (H100/H200: 50 MB)


@dataclass(frozen=True, kw_only=True)
class DeviceCluster:
    cluster: Cluster
    note: str


def cluster_for(gpu_name: str) -> DeviceCluster:
    """The one-device cluster the check prices ``gpu_name`` with (module docstring)."""
    name = gpu_name.upper()
    h100 = preset("dgx-h100").with_shape(num_nodes=1, devices_per_node=1)
    if "H200" in name:
        cluster = replace(h100, name="h200-1", device=H200_141GB)
        return DeviceCluster(cluster=cluster, note="H200: H100's chip with 141 GB HBM3e at 4.8 TB/s (data sheet)")
    if "H100" in name:
        return DeviceCluster(cluster=replace(h100, name="h100-1"), note="H100: the dgx-h100 preset's device")
    for key, preset_name in (("A100", "dgx-a100"), ("V100", "p3.16xlarge")):
        if key in name:
            cluster = preset(preset_name).with_shape(num_nodes=1, devices_per_node=1)
            return DeviceCluster(cluster=cluster, note=f"{key}: the {preset_name} preset's device")
    return DeviceCluster(cluster=replace(h100, name="h100-1"), note=f"{gpu_name!r} is not a known GPU: priced as H100")


def write_cluster(cluster: Cluster, path: Path) -> Path:
    path.write_text(json.dumps(cluster.to_json(), indent=1))
    return path


def machine_info(*, cuda: bool) -> dict[str, Any]:
    """What ran the check: Python, torch, CUDA, the GPU and its memory, the solvers planning needs."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "platform": f"{platform.system()} {platform.machine()}",
        "cpus": os.cpu_count(),
        "gpu": None,
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_bytes"] = int(props.total_memory)
        info["gpu_sms"] = int(props.multi_processor_count)
        info["gpu_capability"] = f"{props.major}.{props.minor}"
    info["solvers"] = {name: _importable(name) for name in ("highspy", "pulp")}
    return info


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@dataclass(frozen=True, kw_only=True)
class Timing:
    median_s: float
    times_s: tuple[float, ...]


@dataclass(frozen=True, kw_only=True)
class Timer:
    """Median seconds of ``repeats`` calls after ``warmup`` calls (module docstring)."""

    cuda: bool
    warmup: int = 3
    repeats: int = 20

    def __call__(self, work: Callable[[], object]) -> Timing:
        for _ in range(self.warmup):
            work()
        flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda") if self.cuda else None
        times = [self._once(work, flush) for _ in range(self.repeats)]
        return Timing(median_s=statistics.median(times), times_s=tuple(times))

    def _once(self, work: Callable[[], object], flush: torch.Tensor | None) -> float:
        if flush is None:
            started = time.perf_counter()
            work()
            return time.perf_counter() - started
        flush.zero_()  # evict the operands from L2: they come from HBM, as the roofline prices them
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
