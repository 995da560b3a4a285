"""The device section of a cluster file (:mod:`cost_models.cluster`): a :class:`~cost_models.device.DeviceSpec`
written as JSON and read back, each field checked (a missing or wrong one is an AutoplanError that names it)."""

from __future__ import annotations

from typing import Any

from cost_models.device import RUNTIME_FIELDS, DeviceSpec
from cost_models.gemm_efficiency import KernelSpec
from planner.errors import AutoplanError


def device_json(device: DeviceSpec) -> dict[str, Any]:
    """The ``device`` section of a cluster file; the optional fields only when set."""
    return {
        "name": device.name,
        "peak_flops": dict(device.peak_flops),
        "memory_bytes": device.memory_bytes,
        "memory_bandwidth": device.memory_bandwidth,
        "compute_efficiency": device.compute_efficiency,
        "memory_efficiency": device.memory_efficiency,
        "kernel_overhead_s": device.kernel_overhead_s,
        "sharded_op_overhead_s": device.sharded_op_overhead_s,
        "microbatch_overhead_s": device.microbatch_overhead_s,
        "step_overhead_s": device.step_overhead_s,
        "shared_slowdown": device.shared_slowdown,
        **({} if device.memory_correction == 1.0 else {"memory_correction": device.memory_correction}),
        "mixed_precision": device.mixed_precision,
        # absent means the default reserve (TOML has no null)
        **({} if device.memory_reserve_bytes is None else {"memory_reserve_bytes": device.memory_reserve_bytes}),
        **({} if device.kernels is None else {"kernels": device.kernels.to_json()}),
    }


def check_peak_flops(device: dict, where: str) -> None:
    """``device.peak_flops`` maps dtypes to positive FLOP/s (checked before the cluster's shape)."""
    peak = device.get("peak_flops")
    if not isinstance(peak, dict) or not peak or not all(_positive(v) for v in peak.values()):
        raise AutoplanError(f"{where}: device.peak_flops must map dtypes to positive FLOP/s, e.g. float32 = 1e12")


def parse_device(device: dict, where: str) -> DeviceSpec:
    """The device of a cluster file's ``device`` section (``where``: the file, for the messages); its
    ``peak_flops`` already checked (:func:`check_peak_flops`)."""
    section = f"{where}: device"
    return DeviceSpec(
        name=str(device.get("name", "device")),
        peak_flops={str(k): float(v) for k, v in device["peak_flops"].items()},
        memory_bytes=number(device, "memory_bytes", section, integer=True),
        memory_bandwidth=number(device, "memory_bandwidth", section),
        compute_efficiency=number(device, "compute_efficiency", section, default=0.6),
        memory_efficiency=number(device, "memory_efficiency", section, default=0.8),
        kernel_overhead_s=number(device, "kernel_overhead_s", section, default=5e-6, allow_zero=True),
        **{key: number(device, key, section, default=0.0, allow_zero=True) for key in RUNTIME_FIELDS},
        shared_slowdown=number(device, "shared_slowdown", section, default=1.0),
        memory_correction=number(device, "memory_correction", section, default=1.0),
        mixed_precision=bool(device.get("mixed_precision", True)),
        memory_reserve_bytes=_reserve(device, where),
        kernels=None if device.get("kernels") is None else KernelSpec.from_json(device["kernels"], where=where),
    )


def _reserve(device: dict, where: str) -> int | None:
    """``device.memory_reserve_bytes``: absent or null for the default, else 0 <= value < memory_bytes."""
    if device.get("memory_reserve_bytes") is None:
        return None
    reserve = number(device, "memory_reserve_bytes", f"{where}: device", integer=True, allow_zero=True)
    if reserve >= device["memory_bytes"]:
        raise AutoplanError(
            f"{where}: device.memory_reserve_bytes ({reserve}) must be less than "
            f"memory_bytes ({device['memory_bytes']})"
        )
    return reserve


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def number(
    data: dict, key: str, where: str, *, integer: bool = False, default: float | None = None, allow_zero: bool = False
) -> Any:
    """``data[key]`` as a positive number (``allow_zero``: or 0; ``integer``: a whole one), ``default`` when absent
    (None: required)."""
    if key not in data:
        if default is not None:
            return default
        raise AutoplanError(f"{where}: missing field {key}")
    value = data[key]
    ok = isinstance(value, int | float) and not isinstance(value, bool) and (value > 0 or (allow_zero and value == 0))
    if integer:
        ok = ok and float(value).is_integer()
    if not ok:
        kind = "a positive integer" if integer else "a positive number"
        raise AutoplanError(f"{where}: field {key} must be {kind}, got {value!r}")
    return int(value) if integer else float(value)
