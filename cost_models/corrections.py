"""Corrections learned from measured plans (``plan tune``): one factor per cost component of a cluster.

Four factors, each 1 when nothing was learned:

* ``compute`` — every operator's time: the device's peak FLOP/s and memory bandwidth divided by it and its
  ``shared_slowdown`` (what profiled times are multiplied by) multiplied by it (:func:`scale_component`);
* ``communication`` — collectives and point-to-point transfers: every link's bandwidth divided by it and its
  latency multiplied by it (one factor: both run on the same links);
* ``host`` — the executors' host overheads: ``kernel_overhead_s``, ``sharded_op_overhead_s``,
  ``microbatch_overhead_s`` and ``step_overhead_s`` multiplied by it;
* ``memory`` — what a plan's memory estimate misses: the budget a plan may use is divided by it
  (:func:`cost_models.cluster.memory_budget_bytes` reads ``DeviceSpec.memory_correction``).

The fit (:func:`fit_corrections`), on candidates ``p`` with printed estimate ``E_p``, measured step ``y_p`` and
the seconds ``T_pc`` of each time component ``c`` in the estimate (its slope in the component's factor at 1,
found by the caller by re-pricing the plan), is ridge regression of the relative errors towards no change::

    g = argmin Σ_p ((E_p + Σ_c g_c·T_pc − y_p) / y_p)² + w·Σ_c g_c²,     factor_c = 1 + g_c

solved in closed form (:func:`_ridge`) and clamped to [:data:`FACTOR_MIN`, :data:`FACTOR_MAX`]; ``w``
(:data:`PRIOR_WEIGHT`) keeps a component the candidates barely exercise near 1. The memory factor is the
largest measured ÷ estimated peak over the candidates (the most any estimate missed by), so a plan that fits
after the correction fits every measured candidate's proportion.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from cost_models.cluster import Cluster, Link

TIME_COMPONENTS = ("compute", "communication", "host")
HOST_FIELDS = ("kernel_overhead_s", "sharded_op_overhead_s", "microbatch_overhead_s", "step_overhead_s")
PRIOR_WEIGHT = 0.05  # the ridge's pull towards 1, against squared relative errors
FACTOR_MIN, FACTOR_MAX = 0.1, 10.0


@dataclass(frozen=True, kw_only=True)
class Corrections:
    compute: float = 1.0
    communication: float = 1.0
    host: float = 1.0
    memory: float = 1.0

    def to_json(self) -> dict[str, float]:
        return {"compute": self.compute, "communication": self.communication, "host": self.host, "memory": self.memory}

    @classmethod
    def from_json(cls, data: Mapping[str, float]) -> Corrections:
        return cls(**{key: float(data.get(key, 1.0)) for key in ("compute", "communication", "host", "memory")})

    def describe(self) -> str:
        """``compute ×1.32, communication ×0.91, host ×2.1, memory ×1.05``."""
        return ", ".join(f"{key} ×{value:.3g}" for key, value in self.to_json().items())


def _scaled_link(link: Link, factor: float) -> Link:
    return Link(bandwidth=link.bandwidth / factor, latency_s=link.latency_s * factor)


def scale_component(cluster: Cluster, component: str, factor: float) -> Cluster:
    """``cluster`` with one component's costs multiplied by ``factor`` (module docstring)."""
    device = cluster.device
    if component == "compute":
        device = replace(
            device,
            peak_flops={k: v / factor for k, v in device.peak_flops.items()},
            memory_bandwidth=device.memory_bandwidth / factor,
            shared_slowdown=device.shared_slowdown * factor,
        )
        return replace(cluster, device=device)
    if component == "communication":
        return replace(
            cluster,
            intra_node=_scaled_link(cluster.intra_node, factor),
            inter_node=_scaled_link(cluster.inter_node, factor),
        )
    if component == "host":
        return replace(cluster, device=replace(device, **{f: getattr(device, f) * factor for f in HOST_FIELDS}))
    if component == "memory":
        return replace(cluster, device=replace(device, memory_correction=device.memory_correction * factor))
    raise ValueError(f"unknown cost component {component!r}")


def apply_corrections(cluster: Cluster, corrections: Corrections) -> Cluster:
    """``cluster`` with every factor of ``corrections`` applied on top of what it already has."""
    for component, factor in corrections.to_json().items():
        if factor != 1.0:
            cluster = scale_component(cluster, component, factor)
    return cluster


@dataclass(frozen=True, kw_only=True)
class CorrectionRow:
    """One measured candidate: its printed estimate, the seconds of each time component in it, what it measured."""

    estimate_s: float
    components_s: Mapping[str, float]
    measured_s: float
    estimated_memory_bytes: float
    measured_memory_bytes: float


def fit_corrections(rows: Sequence[CorrectionRow], *, prior_weight: float = PRIOR_WEIGHT) -> Corrections:
    """The factors that best explain the measured candidates (module docstring); no change without rows."""
    rows = [row for row in rows if row.measured_s > 0]
    if not rows:
        return Corrections()
    matrix = np.array([[row.components_s.get(c, 0.0) / row.measured_s for c in TIME_COMPONENTS] for row in rows])
    target = np.array([(row.measured_s - row.estimate_s) / row.measured_s for row in rows])
    change = _ridge(matrix, target, weight=prior_weight)
    factors = {c: float(np.clip(1.0 + g, FACTOR_MIN, FACTOR_MAX)) for c, g in zip(TIME_COMPONENTS, change, strict=True)}
    memory = [
        row.measured_memory_bytes / row.estimated_memory_bytes
        for row in rows
        if row.estimated_memory_bytes > 0 and row.measured_memory_bytes > 0
    ]
    factors["memory"] = float(np.clip(max(memory), FACTOR_MIN, FACTOR_MAX)) if memory else 1.0
    return Corrections(**factors)


def _ridge(matrix: np.ndarray, target: np.ndarray, *, weight: float) -> np.ndarray:
    """``argmin ‖A g − b‖² + w ‖g‖²`` = ``(AᵀA + w I)⁻¹ Aᵀ b``."""
    columns = matrix.shape[1]
    return np.linalg.solve(matrix.T @ matrix + weight * np.eye(columns), matrix.T @ target)
