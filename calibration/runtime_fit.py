"""Fit the executors' host overheads from probe plans measured on this machine.

The cost model charges five runtime constants (all additive, so an estimate is linear in them):

* ``kernel_overhead_s``      per operator per pass on plain tensors  — cost_models.compute
* ``sharded_op_overhead_s``  per operator per pass on a multi-device stage, and per parameter
                             update there                            — planner.costing.node_cost.sharded_dispatch_s
* ``microbatch_overhead_s``  per pipeline stage per microbatch       — planner.inter.pricing.price_stages
* ``step_overhead_s``        once per step                           — planner.costing.setup and every estimate path
* ``latency_s``              per collective step or message          — cost_models.communication
                             (α, both links)

For probe plan ``p`` with measured step ``y_p``, the estimate with all five at 0 is ``e_p`` and the
estimate's slope in constant ``k`` is ``F_pk = (estimate(k = δ) − e_p) / δ`` (the others at 0),
computed by :func:`probe_features` from any ``estimate(cluster)`` callable. The roofline's
arithmetic is not fitted here: fitting a compute scale on the probes made it ill-conditioned on
this machine (the matmul samples set it). :func:`fit_runtime`
solves the non-negative least squares of the relative errors::

    minimise  Σ_p ((e_p + Σ_k F_pk · x_k − y_p) / y_p)²   subject to  x ≥ 0

exactly, by trying every subset of free constants (:func:`_nnls`; five constants, 31 subsets), and
:func:`apply_runtime` writes ``x`` into a cluster.

Compute contention (optional sixth constant ``compute_extra``, :data:`COMPUTE`): with operator times
profiled by one process (``--cost-model profiled``), the processes of a step share the cores with
each other and with whatever else runs on the machine, so a step's compute takes ``(1 + c)`` times
the profiled time × ``shared_slowdown``. When probes with real arithmetic are given a ``scaled``
estimate, their feature is ``F_pc = (estimate(compute × (1 + δ_c)) − e_p) / δ_c`` and ``c`` is
fitted with the others, of either sign but at least ``−0.5`` (the one-process profiles can be taken
while the machine is busier than when the plans run; its column is left out of the non-negativity
test of :func:`_nnls` and the result clamped); :func:`apply_runtime` then multiplies the device's ``shared_slowdown`` by
``1 + c`` and divides its peak FLOP/s and memory bandwidth by it, so the profiled and the roofline
compute both carry it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from cost_models.cluster import Cluster
from planner.errors import AutoplanError

CONSTANTS = ("kernel_overhead_s", "sharded_op_overhead_s", "microbatch_overhead_s", "step_overhead_s", "latency_s")
COMPUTE = "compute_extra"  # optional: extra share of compute time under contention (module docstring)
DELTA_S = 1e-3  # the step used for the slopes: large against float noise, small against a max() switching
DELTA_COMPUTE = 0.05  # the relative step of the compute slope
COMPUTE_FLOOR = -0.5  # compute_extra below this is not contention but a broken profile: clamp


def apply_runtime(cluster: Cluster, values: Mapping[str, float]) -> Cluster:
    """``cluster`` with the runtime constants in ``values`` (the others as they are)."""
    unknown = set(values) - {*CONSTANTS, COMPUTE}
    assert not unknown, f"unknown runtime constants {sorted(unknown)}"
    device = replace(cluster.device, **{k: float(v) for k, v in values.items() if k not in ("latency_s", COMPUTE)})
    if values.get(COMPUTE):
        scale = 1.0 + float(values[COMPUTE])
        device = replace(
            device,
            shared_slowdown=device.shared_slowdown * scale,
            peak_flops={k: v / scale for k, v in device.peak_flops.items()},
            memory_bandwidth=device.memory_bandwidth / scale,
        )
    result = replace(cluster, device=device)
    if "latency_s" in values:
        latency = float(values["latency_s"])
        result = replace(
            result,
            intra_node=replace(cluster.intra_node, latency_s=latency),
            inter_node=replace(cluster.inter_node, latency_s=latency),
        )
    return result


@dataclass(frozen=True, kw_only=True)
class ProbeRow:
    name: str
    measured_s: float
    base_s: float  # the estimate with every runtime constant at 0
    features: Mapping[str, float]  # d estimate / d constant


@dataclass(frozen=True, kw_only=True)
class RuntimeFit:
    values: Mapping[str, float]
    rows: tuple[ProbeRow, ...]

    def predicted_s(self, row: ProbeRow) -> float:
        return row.base_s + sum(row.features.get(k, 0.0) * v for k, v in self.values.items())

    def to_json(self) -> dict:
        return {
            "values": dict(self.values),
            "probes": [
                {
                    "name": r.name,
                    "measured_s": r.measured_s,
                    "fitted_s": self.predicted_s(r),
                    "base_s": r.base_s,
                    "features": dict(r.features),
                }
                for r in self.rows
            ],
        }


def probe_features(
    estimate: Callable[[Cluster], float],
    cluster: Cluster,
    *,
    scaled: Callable[[Cluster, float], float] | None = None,
    constants: Sequence[str] = CONSTANTS,
) -> tuple[float, dict[str, float]]:
    """``(e, F)`` of one probe: its estimate with ``constants`` at 0 (the others as ``cluster`` has
    them), and its slope in each; with ``scaled`` (the estimate with compute times × a factor) also
    the slope in :data:`COMPUTE`."""
    zero = apply_runtime(cluster, dict.fromkeys(constants, 0.0))
    base = estimate(zero)
    features = {}
    for name in constants:
        features[name] = (estimate(apply_runtime(zero, {name: DELTA_S})) - base) / DELTA_S
    if scaled is not None:
        features[COMPUTE] = (scaled(zero, 1.0 + DELTA_COMPUTE) - base) / DELTA_COMPUTE
    return base, features


def fit_runtime(rows: Sequence[ProbeRow]) -> RuntimeFit:
    """The non-negative constants that best fit the probes' relative errors (module docstring): those
    every probe has a feature for (the compute constant among them when given)."""
    constants = tuple(k for k in (*CONSTANTS, COMPUTE) if rows and all(k in row.features for row in rows))
    if len(rows) < len(constants):
        raise AutoplanError(
            f"fitting {len(constants)} runtime constants needs at least as many probes, got {len(rows)}"
        )
    if any(row.measured_s <= 0 for row in rows):
        raise AutoplanError("every probe must have a positive measured step time")
    weight = np.array([1.0 / row.measured_s for row in rows])
    matrix = np.array([[row.features[k] for k in constants] for row in rows]) * weight[:, None]
    target = np.array([row.measured_s - row.base_s for row in rows]) * weight
    values = _nnls(matrix, target, signed=[k == COMPUTE for k in constants])
    values = [max(v, COMPUTE_FLOOR) if k == COMPUTE else v for k, v in zip(constants, values, strict=True)]
    return RuntimeFit(values=dict(zip(constants, (float(v) for v in values), strict=True)), rows=tuple(rows))


def _nnls(matrix: np.ndarray, target: np.ndarray, *, signed: Sequence[bool] | None = None) -> np.ndarray:
    """argmin ‖A x − b‖ over x ≥ 0 (but the ``signed`` columns), exactly for a handful of columns: the
    best feasible subset fit."""
    constrained = ~np.array(signed, dtype=bool) if signed is not None else np.ones(matrix.shape[1], dtype=bool)
    columns = matrix.shape[1]
    best, best_residual = np.zeros(columns), float(np.sum(target**2))
    for size in range(1, columns + 1):
        for subset in itertools.combinations(range(columns), size):
            solution, *_ = np.linalg.lstsq(matrix[:, subset], target, rcond=None)
            if np.any((solution < 0) & constrained[list(subset)]):
                continue
            x = np.zeros(columns)
            x[list(subset)] = solution
            residual = float(np.sum((matrix @ x - target) ** 2))
            if residual < best_residual - 1e-18:
                best, best_residual = x, residual
    return best
