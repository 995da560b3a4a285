"""Fit this machine's cost-model figures from measured samples (``plan calibrate``).

Pure: the measurements come from :mod:`calibration.measure`; this module only fits them.

Collectives (one :class:`Sample` per message size ``b``, median seconds ``t``, ``n`` devices)
follow the α-β shapes of :mod:`cost_models.communication`::

    t = k_α(n)·α + k_β(n)·b·β          β = 1 / bandwidth

with ``(k_α, k_β)`` = ``(2(n−1), 2(n−1)/n)`` for all-reduce, ``(n−1, (n−1)/n)`` for
all-gather (``b`` = gathered size) and ``(1, 1)`` for point-to-point (``b`` one way), read off
the communication functions themselves by :func:`collective_coefficients`. :func:`fit_alpha_beta`
solves for ``(α, β)`` by least squares on relative errors (each row divided by ``t``, so 1 KiB and
16 MiB messages weigh alike); when that gives ``α < 0`` or ``β ≤ 0`` it refits with ``α = 0``,
which always yields ``β > 0`` for positive times (a two-variable non-negative least squares).

Compute (:func:`fit_matmul`), from fp32 matmuls of ``f = 2·m³`` FLOPs::

    peak_flops        = max over sizes of f / t        (each t already a median of repeats)
    kernel_overhead_s = max(0, t₀ − f₀ / peak_flops)  (t₀, f₀: the smallest matmul)

The per-operator overhead a training step pays on top of the roofline is the larger of that matmul
intercept and the measured eager overhead of a tiny operator (``op_overhead`` samples: a chain of
elementwise operators on a few elements, forward and backward through autograd, seconds per
operator per pass) — on a CPU the framework's dispatch and autograd bookkeeping, not the kernel,
sets the floor of every small operator (:func:`fit_calibration`).

Sharing (:func:`shared_slowdown`): rank 0 also times the ``ALONE_MATMUL_SIZE`` matmul alone, the
others waiting; ``shared_slowdown = max(1, t_all / t_alone)``. Operator times profiled by one process
alone (:class:`cost_models.compute.ProfiledCompute`) are multiplied by it: with more processes than
cores, each gets its share.

Memory (:func:`fit_memory_bandwidth`), from large copies and adds moving ``m`` bytes
(read + write): ``memory_bandwidth = median of m / t``.

:meth:`CalibrationResult.to_cluster` turns the fits into a :class:`~cost_models.cluster.Cluster`
whose roofline (:mod:`cost_models.compute`) uses the measured peaks at efficiency 1.0 (they are
already achieved figures) and whose links are the all-reduce fit. :func:`to_toml` writes the
cluster-file dict as TOML.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from calibration.runtime_fit import RuntimeFit, apply_runtime
from cost_models.cluster import Cluster, Link, preset
from cost_models.communication import all_gather_s, all_reduce_s, p2p_s
from planner.errors import AutoplanError

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "p2p")
MEMORY_KINDS = ("memory_copy", "memory_add")
MATMUL_KIND = "matmul"
OP_OVERHEAD_KIND = "op_overhead"
MATMUL_ALONE_KIND = "matmul_alone"
ALONE_MATMUL_SIZE = 512  # in every matmul size list of calibration.measure, so it is also timed with all running
LINK_FIT = "all_reduce"  # the fit that becomes the cluster's links: collectives dominate training traffic
CALIBRATED_NAME = "local-cpu-calibrated"


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One measurement: median ``seconds`` of ``kind`` moving ``num_bytes`` (and ``flops``)."""

    kind: str
    num_devices: int
    num_bytes: int
    seconds: float
    flops: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "num_devices": self.num_devices,
            "num_bytes": self.num_bytes,
            "seconds": self.seconds,
            "flops": self.flops,
        }


@dataclass(frozen=True, kw_only=True)
class MatmulFit:
    peak_flops: float
    kernel_overhead_s: float


def _p2p_time(num_bytes: float, *, num_devices: int, link: Link) -> float:
    return p2p_s(num_bytes, link=link)


_COLLECTIVE_TIMES: dict[str, Callable[..., float]] = {
    "all_reduce": all_reduce_s,
    "all_gather": all_gather_s,
    "p2p": _p2p_time,
}


def collective_coefficients(kind: str, *, num_devices: int) -> tuple[float, float]:
    """``(k_α, k_β)`` of ``kind`` on ``num_devices``, evaluated from :mod:`cost_models.communication`."""
    if kind not in _COLLECTIVE_TIMES:
        raise AutoplanError(f"unknown collective {kind!r} to fit: use one of {', '.join(COLLECTIVE_KINDS)}")
    time_s = _COLLECTIVE_TIMES[kind]
    latency_steps = time_s(1.0, num_devices=num_devices, link=Link(bandwidth=math.inf, latency_s=1.0))
    byte_factor = time_s(1.0, num_devices=num_devices, link=Link(bandwidth=1.0, latency_s=0.0))
    if latency_steps <= 0 or byte_factor <= 0:
        raise AutoplanError(f"{kind} samples need at least 2 devices to fit, got {num_devices}")
    return latency_steps, byte_factor


def _check_samples(rows: Sequence[tuple[float, float]], what: str) -> None:
    if not rows:
        raise AutoplanError(f"no {what} samples to fit: measure at least one size")
    for num, seconds in rows:
        if not (num > 0 and seconds > 0 and math.isfinite(num) and math.isfinite(seconds)):
            raise AutoplanError(f"{what} sample ({num}, {seconds}) must have positive, finite size and seconds")


def _fit_rows(latency_steps: np.ndarray, byte_terms: np.ndarray, seconds: np.ndarray) -> Link:
    """Relative-error least squares of ``seconds ≈ latency_steps·α + byte_terms·β`` with α ≥ 0, β > 0."""
    weights = 1.0 / seconds
    design = np.column_stack([latency_steps * weights, byte_terms * weights])
    target = np.ones_like(seconds)
    if np.linalg.matrix_rank(design) == 2:
        (alpha, beta), *_ = np.linalg.lstsq(design, target, rcond=None)
        if alpha >= 0 and beta > 0:
            return Link(bandwidth=float(1.0 / beta), latency_s=float(alpha))
    column = design[:, 1]
    beta = float(column @ target / (column @ column))
    return Link(bandwidth=1.0 / beta, latency_s=0.0)


def fit_alpha_beta(samples: Sequence[tuple[float, float]], *, latency_steps: float, byte_factor: float) -> Link:
    """Fit ``t = latency_steps·α + byte_factor·b/bandwidth`` to ``(bytes, seconds)`` samples."""
    _check_samples(samples, "communication")
    if latency_steps <= 0 or byte_factor <= 0:
        raise AutoplanError(f"fit coefficients must be positive, got {latency_steps} and {byte_factor}")
    num_bytes = np.array([b for b, _ in samples], dtype=float)
    seconds = np.array([t for _, t in samples], dtype=float)
    return _fit_rows(np.full_like(seconds, latency_steps), byte_factor * num_bytes, seconds)


def fit_collective(kind: str, samples: Sequence[Sample]) -> Link:
    """The α-β link of collective ``kind`` from its samples (any mix of device counts)."""
    _check_samples([(s.num_bytes, s.seconds) for s in samples], kind)
    coefficients = [collective_coefficients(kind, num_devices=s.num_devices) for s in samples]
    latency_steps = np.array([k_alpha for k_alpha, _ in coefficients])
    byte_terms = np.array([k_beta * s.num_bytes for (_, k_beta), s in zip(coefficients, samples, strict=True)])
    return _fit_rows(latency_steps, byte_terms, np.array([s.seconds for s in samples], dtype=float))


def fit_matmul(samples: Sequence[tuple[float, float]]) -> MatmulFit:
    """Achieved FLOP/s (best size) and launch overhead (smallest size) from ``(flops, seconds)``."""
    _check_samples(samples, "matmul")
    peak_flops = max(flops / seconds for flops, seconds in samples)
    smallest_flops, smallest_s = min(samples)
    return MatmulFit(peak_flops=peak_flops, kernel_overhead_s=max(0.0, smallest_s - smallest_flops / peak_flops))


def fit_memory_bandwidth(samples: Sequence[tuple[float, float]]) -> float:
    """Bytes/s from ``(bytes moved, seconds)`` of large copies: the median achieved rate."""
    _check_samples(samples, "memory")
    return statistics.median(num_bytes / seconds for num_bytes, seconds in samples)


@dataclass(frozen=True, kw_only=True)
class CalibrationResult:
    """Raw samples, the fitted link per collective, and the compute figures of one run."""

    samples: tuple[Sample, ...]
    links: Mapping[str, Link]
    matmul: MatmulFit
    memory_bandwidth: float
    num_processes: int
    hostname: str
    torch_version: str
    date: str
    runtime: RuntimeFit | None = None  # the executors' host overheads, fitted on probe plans
    shared_slowdown: float = 1.0  # reference matmul with all processes running / alone (at least 1)

    def to_cluster(self, base: Cluster | None = None) -> Cluster:
        """``base`` (the ``local-cpu`` preset by default) with the measured figures."""
        base = base if base is not None else preset("local-cpu")
        if LINK_FIT not in self.links:
            raise AutoplanError(f"calibration has no {LINK_FIT} fit: measure {LINK_FIT} to build a cluster")
        peak = self.matmul.peak_flops
        device = replace(
            base.device,
            peak_flops={"float32": peak, "bfloat16": peak, "float16": peak},
            memory_bandwidth=self.memory_bandwidth,
            compute_efficiency=1.0,
            memory_efficiency=1.0,
            kernel_overhead_s=self.matmul.kernel_overhead_s,
            shared_slowdown=self.shared_slowdown,
        )
        link = self.links[LINK_FIT]
        summary = {
            "by": "plan calibrate",
            "date": self.date,
            "hostname": self.hostname,
            "torch_version": self.torch_version,
            "num_processes": self.num_processes,
        }
        cluster = replace(
            base,
            name=CALIBRATED_NAME,
            num_nodes=1,
            devices_per_node=self.num_processes,
            device=device,
            intra_node=link,
            inter_node=link,
            source="calibration",
            calibration=summary,
        )
        return apply_runtime(cluster, self.runtime.values) if self.runtime is not None else cluster

    def to_json(self, base: Cluster | None = None) -> dict[str, Any]:
        """The cluster-file fields of :meth:`to_cluster` plus a ``calibration`` section."""
        data = self.to_cluster(base).to_json()
        data["calibration"] = {
            "by": "plan calibrate",
            "date": self.date,
            "hostname": self.hostname,
            "torch_version": self.torch_version,
            "num_processes": self.num_processes,
            "links_from": LINK_FIT,
            "links": {
                kind: {"latency_s": link.latency_s, "bandwidth": link.bandwidth} for kind, link in self.links.items()
            },
            "compute": {
                "peak_flops": self.matmul.peak_flops,
                "kernel_overhead_s": self.matmul.kernel_overhead_s,
                "memory_bandwidth": self.memory_bandwidth,
                "shared_slowdown": self.shared_slowdown,
            },
            "samples": [sample.to_json() for sample in self.samples],
        }
        if self.runtime is not None:
            data["calibration"]["runtime"] = self.runtime.to_json()
        return data


def shared_slowdown(shared: Sequence[Sample], alone: Sequence[Sample]) -> float:
    """Seconds of the reference matmul with every process running over seconds alone; 1 without both.

    At least 1: sharing the machine cannot make a process faster, and a ratio below 1 is timer noise."""
    by_flops = {sample.flops: sample.seconds for sample in shared}
    ratios = [by_flops[sample.flops] / sample.seconds for sample in alone if sample.flops in by_flops]
    return max(1.0, statistics.median(ratios)) if ratios else 1.0


def fit_calibration(
    samples: Sequence[Sample], *, num_processes: int, hostname: str, torch_version: str, date: str
) -> CalibrationResult:
    """Fit every collective present, the matmul and the memory samples of one run."""
    by_kind: dict[str, list[Sample]] = {}
    for sample in samples:
        by_kind.setdefault(sample.kind, []).append(sample)
    links = {kind: fit_collective(kind, by_kind[kind]) for kind in COLLECTIVE_KINDS if kind in by_kind}
    memory = [(s.num_bytes, s.seconds) for kind in MEMORY_KINDS for s in by_kind.get(kind, [])]
    matmul = fit_matmul([(s.flops, s.seconds) for s in by_kind.get(MATMUL_KIND, [])])
    eager = [s.seconds for s in by_kind.get(OP_OVERHEAD_KIND, [])]
    if eager:
        matmul = replace(matmul, kernel_overhead_s=max(matmul.kernel_overhead_s, statistics.median(eager)))
    return CalibrationResult(
        shared_slowdown=shared_slowdown(by_kind.get(MATMUL_KIND, []), by_kind.get(MATMUL_ALONE_KIND, [])),
        samples=tuple(samples),
        links=links,
        matmul=matmul,
        memory_bandwidth=fit_memory_bandwidth(memory),
        num_processes=num_processes,
        hostname=hostname,
        torch_version=torch_version,
        date=date,
    )


def to_toml(data: Mapping[str, Any]) -> str:
    """``data`` (nested dicts, scalars, lists, lists of dicts) as a TOML document."""
    lines: list[str] = []
    _toml_table(data, path=(), lines=lines)
    return "\n".join(lines).strip() + "\n"


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(item, Mapping) for item in value)


def _toml_table(table: Mapping[str, Any], *, path: tuple[str, ...], lines: list[str]) -> None:
    nested = {k: v for k, v in table.items() if isinstance(v, Mapping) or _is_table_array(v)}
    for key, value in table.items():
        if key not in nested:
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, value in nested.items():
        header = ".".join(_toml_key(part) for part in (*path, key))
        items = [value] if isinstance(value, Mapping) else value
        for item in items:
            lines.extend(["", f"[{header}]" if isinstance(value, Mapping) else f"[[{header}]]"])
            _toml_table(item, path=(*path, key), lines=lines)


def _toml_key(key: str) -> str:
    bare = key and all(c.isascii() and (c.isalnum() or c in "_-") for c in key)
    return key if bare else json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value) if isinstance(value, int) or math.isfinite(value) else _toml_special(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise AutoplanError(f"cannot write {type(value).__name__} value {value!r} to TOML")


def _toml_special(value: float) -> str:
    if math.isnan(value):
        return "nan"
    return "inf" if value > 0 else "-inf"
