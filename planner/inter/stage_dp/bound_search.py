"""The stage DP's runs: one DP at a bound on stage times, and the best-first search over bounds (Alpa §5, exact).

The problem, the classes ``c`` and the tables ``τ_c(k, i, j)``, ``b(i, j, j')``: :mod:`planner.inter.stage_dp.solver`.

For one bound ``t_max`` (:func:`_dp`), ``F(c, k, d, j)`` is the least ``Σ t`` of stages covering layers
``k..L−1`` on ``d`` devices in class ``c``, the first on submesh ``j`` (its boundary needs the next one)::

    F(c, k, d, j) = min τ_c(k, i, j) + b(i, j, j') + F(c', i+1, d − |j|, j')                     (_step)
                    over i ∈ [k, L−2], j', c' following c, with τ_c(k, i, j) + b(i, j, j') ≤ t_max
    F(0, k, |j|, j) = τ_1(k, L−1, j) if ≤ t_max (a last stage; the min of both)                 (_final)
    Σ*(t_max) = min_{c, j} F(c, 0, D, j)                                                        (_trace)

The admissible ``j'`` are a prefix of ``j'`` sorted by ``b(i, j, ·)``, so the min over ``j'`` and ``c'`` is a
prefix-min built once per ``i`` (:func:`_prefix`) and gathered for all ``k`` in numpy: ``O(L²·C·J·D)`` a run,
with ``D`` counted in units of the submeshes' common divisor (whole nodes on a large cluster).

Exactness. Candidates are the stage times that can occur: ``τ_c + b``, and ``τ_1`` of last stages
(:func:`_candidates`). Let ``P*`` be optimal with max ``m*``, a candidate. At ``t_max = m*`` the DP returns
``P`` with ``Σ_P ≤ Σ_P*`` and ``max_P ≤ m*``, so its latency *recomputed* with its true max is
``Σ_P + (B−1)·max_P ≤ T*``; every recomputed latency is a real plan's, so the least one is ``T*``.

Search (:func:`search_bounds`), a best-first form of Alpa's early stop. ``Σ*`` is non-increasing in ``t_max``,
so a run at candidate ``t`` settles every candidate in ``[max_P, t]``, and an infeasible one all below
``t``. A plan whose max ``m`` lies in an unsettled interval ``[t_a, t_b]`` below a run at ``t`` has
``Σ ≥ Σ*(t)`` and ``Σ ≥ m``, hence ``T ≥ max(Σ*(t) + (B − 1)·t_a, B·t_a)`` (:func:`_push`). Intervals are
bisected lowest bound first until that bound reaches the best ``T``; candidates with ``B·t ≥ T`` of the
first run (``t_max = ∞``) are never listed. This is DESIGN.md's stop ``B·t_max ≥ T*`` with a tighter
bound; ``early_stop=False`` runs the DP at every candidate, ascending.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

UNBOUNDED = float(np.finfo(np.float64).max)  # t_max for "no bound" that an infinite τ still exceeds


@dataclass(frozen=True, kw_only=True)
class DpTables:
    """What every DP run reads: stage times per class, boundaries, and the device counts in units."""

    sizes: np.ndarray  # (J,) units per submesh (a unit: the submeshes' common divisor of devices)
    times: np.ndarray  # (C, L, L, J) τ_c(k, i, j), inf where nothing fits
    boundary: np.ndarray  # (L−1, J, J) b(i, j, j')
    order: np.ndarray  # (L−1, J, J) j' sorted by b(i, j, ·)
    sorted_boundary: np.ndarray  # (L−1, J, J) b(i, j, order[i, j, ·])
    open_class: bool  # class C−1 holds ≥ C stages
    num_devices: int  # in units
    num_microbatches: int


@dataclass(frozen=True, kw_only=True)
class DpRun:
    """One DP run's plan: stages (first, last, submesh index, stage time), its DP sum and true max."""

    path: tuple[tuple[int, int, int, float], ...]
    sigma: float
    max_s: float

    def latency(self, num_microbatches: int) -> float:
        return math.fsum(stage[3] for stage in self.path) + (num_microbatches - 1) * self.max_s


def search_bounds(tables: DpTables, early_stop: bool) -> tuple[DpRun | None, int]:
    """The run of least recomputed latency and the number of DP runs (see the module docstring)."""
    prefix, batches = _Scratch(tables), tables.num_microbatches
    if not early_stop:
        runs = [_dp(tables, float(t), prefix) for t in _candidates(tables, UNBOUNDED)]
        found = [run for run in runs if run is not None]
        return min(found, key=lambda run: run.latency(batches), default=None), len(runs)
    best = _dp(tables, UNBOUNDED, prefix)
    if best is None:
        return None, 1
    candidates, tried, heap = _candidates(tables, best.latency(batches) / batches), 1, []
    _push(heap, candidates, 0, int(np.searchsorted(candidates, best.max_s)) - 1, best.sigma, batches)
    while heap and heap[0][0] < best.latency(batches):
        _, a, b, sigma = heapq.heappop(heap)
        middle = (a + b) // 2
        run, tried = _dp(tables, float(candidates[middle]), prefix), tried + 1
        if run is not None:
            best = min(best, run, key=lambda found: found.latency(batches))
            below = min(int(np.searchsorted(candidates, run.max_s)) - 1, middle - 1)  # max_s ≤ t_max
            _push(heap, candidates, a, below, run.sigma, batches)
        _push(heap, candidates, middle + 1, b, sigma, batches)
    return best, tried


def _push(heap: list, candidates: np.ndarray, a: int, b: int, sigma: float, batches: int) -> None:
    """Queue unsettled candidates ``a..b`` (``sigma`` ≤ Σ* on them) under their bound on ``T``."""
    if a <= b:
        low = float(candidates[a])
        heapq.heappush(heap, (max(sigma + (batches - 1) * low, batches * low), a, b, sigma))


def _candidates(tables: DpTables, below: float) -> np.ndarray:
    """The distinct stage times ``τ_c + b`` and last stages' ``τ_1`` under ``below``, ascending."""
    num_layers = tables.times.shape[1]
    rows = tables.times[: tables.num_microbatches]  # exact classes past B repeat class B − 1
    inner = rows[:, :, : num_layers - 1, :, None] + tables.boundary[None, None]
    values = np.concatenate([inner.ravel(), tables.times[0, :, num_layers - 1].ravel()])
    return np.unique(values[values < below])


class _Scratch:
    """Prefix-mins ``P[c, i, j, p, d]`` of one DP run (:func:`_prefix`), reused across runs, the row of
    ``P[c, i, j, 0]`` in its flat ``(rows, d)`` view, for gathering whole ``d`` rows at once, and the
    run's ``F`` (:func:`_dp`)."""

    def __init__(self, tables: DpTables) -> None:
        num_classes, num_layers, _, num_meshes = tables.times.shape
        shape = (num_classes, max(num_layers - 1, 0), num_meshes, num_meshes + 1, tables.num_devices + 1)
        self.prefix = np.full(shape, np.inf)
        self.rows = self.prefix.reshape(-1, shape[-1])
        self.first_row = (num_meshes + 1) * np.arange(math.prod(shape[:3])).reshape(shape[:3])
        self.value = np.empty((num_classes, num_layers, num_meshes, tables.num_devices + 1))  # F, refilled per run


def _dp(tables: DpTables, t_max: float, scratch: _Scratch) -> DpRun | None:
    """The least-Σ plan with every stage time ≤ t_max, or None; ``value[c, k, j, d] = F(c, k, d, j)``."""
    num_layers = tables.times.shape[1]
    value = scratch.value  # written page by page once, refilled here: a fresh array per run costs page faults
    value.fill(np.inf)
    for k in range(num_layers - 1, -1, -1):
        if k < num_layers - 1:
            value[:, k] = _step(tables, t_max, scratch, k).min(axis=1)
        _final(tables, t_max, value, k)
        if k:
            _prefix(tables, value[:, k], scratch.prefix[:, k - 1], k - 1)
    return _trace(tables, t_max, value, scratch)


def _step(tables: DpTables, t_max: float, scratch: _Scratch, k: int) -> np.ndarray:
    """``[c, i − k, j, d]``: first stage ``k..i`` (``i < L − 1``) plus the best admissible rest, from ``P``."""
    end = tables.times.shape[1] - 1
    tau = tables.times[:, k, k:end]  # (C, i, j)
    count = (tau[..., None] + tables.sorted_boundary[k:end] <= t_max).sum(axis=-1)  # admissible j'
    total = np.take(scratch.rows, scratch.first_row[:, k:end] + count, axis=0)  # (C, i, j, d)
    return np.add(total, tau[..., None], out=total)


def _final(tables: DpTables, t_max: float, value: np.ndarray, k: int) -> None:
    """A last stage ``k..L−1`` (one microbatch in flight, no boundary), in class 0."""
    tau, meshes = tables.times[0, k, -1], np.arange(len(tables.sizes))
    better = (tau <= t_max) & (tau < value[0, k, meshes, tables.sizes])
    value[0, k, meshes[better], tables.sizes[better]] = tau[better]


def _prefix(tables: DpTables, after: np.ndarray, out: np.ndarray, i: int) -> None:
    """``out[c, j, p, d] = min`` over the first ``p`` of ``j'`` sorted by ``b(i, j, ·)`` and ``c'`` following
    ``c`` of ``b(i, j, j') + F(c', i+1, d − |j|, j')``; ``after = F(·, i+1, ·, ·)``. p = 0 stays inf."""
    following = np.full_like(after, np.inf)
    following[1:] = after[:-1]
    if tables.open_class:
        np.minimum(following[-1], after[-1], out=following[-1])
    ordered = following[:, tables.order[i]]  # (C, j, p, d)
    ordered += tables.sorted_boundary[i][None, :, :, None]
    for p in range(1, ordered.shape[2]):  # a running min: faster than minimum.accumulate on a middle axis
        np.minimum(ordered[:, :, p], ordered[:, :, p - 1], out=ordered[:, :, p])
    num_devices = after.shape[-1] - 1
    for j, size in enumerate(tables.sizes):
        out[:, j, 1:, size:] = ordered[:, j, :, : num_devices + 1 - size]


def _trace(tables: DpTables, t_max: float, value: np.ndarray, scratch: _Scratch) -> DpRun | None:
    """The plan behind ``Σ*(t_max)``: per stage the argmin over its last layer, then the next submesh and class."""
    top = value[:, 0, :, tables.num_devices]
    c, j = (int(x) for x in np.unravel_index(int(np.argmin(top)), top.shape))
    sigma = float(top[c, j])
    if not math.isfinite(sigma):
        return None
    path, k, devices = [], 0, tables.num_devices
    while (i := _last_layer(tables, t_max, scratch, c, k, j, devices)) < tables.times.shape[1] - 1:
        tau = float(tables.times[c, k, i, j])
        devices -= int(tables.sizes[j])
        step, c, following = _follow(tables, t_max, value, c, i, j, devices, tau)
        path.append((k, i, j, tau + step))
        k, j = i + 1, following
    path.append((k, i, j, float(tables.times[0, k, i, j])))
    return DpRun(path=tuple(path), sigma=sigma, max_s=max(stage[3] for stage in path))


def _last_layer(tables: DpTables, t_max: float, scratch: _Scratch, c: int, k: int, j: int, devices: int) -> int:
    """The ``i`` behind ``F(c, k, devices, j)``: :func:`_step`'s argmin, or ``L − 1`` where :func:`_final` won."""
    last = tables.times.shape[1] - 1
    steps = _step(tables, t_max, scratch, k)[c, :, j, devices] if k < last else np.full(1, np.inf)
    tau = float(tables.times[0, k, last, j])
    final = c == 0 and devices == tables.sizes[j] and tau <= t_max and tau < steps.min()
    return last if final else k + int(np.argmin(steps))


def _follow(
    tables: DpTables, t_max: float, value: np.ndarray, c: int, i: int, j: int, devices: int, tau: float
) -> tuple[float, int, int]:
    """(boundary, class, submesh) of the stage after ``k..i`` on ``j``: the argmin behind ``_prefix``."""
    classes = [c - 1] if c else []
    if tables.open_class and c == len(tables.times) - 1:
        classes.append(c)
    count = int((tau + tables.sorted_boundary[i, j] <= t_max).sum())
    after = [(float(tables.boundary[i, j, n]), cn, int(n)) for cn in classes for n in tables.order[i, j, :count]]
    return min(after, key=lambda found: found[0] + float(value[found[1], i + 1, found[2], devices]))
