"""Slice layers into pipeline stages, each on a submesh: the inter-operator DP of Alpa §5, exact.

``L`` layers, ``N`` nodes of ``M`` devices, ``D = N·M``, ``B`` microbatches, submeshes ``j`` (:func:`submeshes`).
A plan is ``S ≥ 1`` contiguous stages ``k_s..i_s`` on submeshes ``j_s`` with ``Σ_s |j_s| = D`` (all devices
used, as in Alpa), each running one option ``o_s`` of ``costs.options(k_s, i_s, j_s)``. With ``b(i, j, j')``
the optional ``boundary_s`` (p2p of activations and gradients to the next stage, charged to the sender)::

    t_s = o_s.time_s + b(i_s, j_s, j_{s+1})   (none after the last stage)                       (_plan)
    T   = Σ_s t_s + (B − 1)·max_s t_s          (Alpa's pipeline latency)                          (_plan)
    o_s.state_bytes + o_s.activation_bytes·min(S − s, B) ≤ budget   (1F1B in flight)   (_fitting_times)
                                                ·B for GPipe (every microbatch in flight: one class)

Only the memory check sees a stage's position, through ``f = min(S − s, B)``, so the fastest fitting
option ``τ_f(k, i, j)`` beats the others of its span, submesh and ``f``: lower sum and max alike.
``τ_f`` stops changing at some ``f = C ≤ B`` (:func:`_classes`): class ``c < C − 1`` holds sub-pipelines
of exactly ``c + 1`` stages, class ``C − 1`` those of ``≥ C`` (followed by class ``C − 2`` or itself). With
ample memory ``C = 1``; a ``max_stages`` below ``min(L, D)`` makes every class exact instead.

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

Search (:func:`_search`), a best-first form of Alpa's early stop. ``Σ*`` is non-increasing in ``t_max``,
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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cost_models.cluster import Cluster
from cost_models.units import GIB
from planner.errors import AutoplanError
from planner.inter.device_blocks import Submesh

_UNBOUNDED = float(np.finfo(np.float64).max)
WHOLE_NODE_LIMIT = 32  # nodes; past it submeshes are whole nodes dividing the cluster (:func:`submeshes`)  # t_max for "no bound" that an infinite τ still exceeds


@dataclass(frozen=True, kw_only=True, slots=True)
class StageOption:
    """One way to run a span of layers on a submesh (a logical mesh, remat or not, ...)."""

    time_s: float  # forward + backward of ONE microbatch through the stage, its own communication included
    state_bytes: float  # parameters, gradients, optimizer state per device
    activation_bytes: float  # activations kept per in-flight microbatch per device
    label: object = None  # opaque to the DP

    def __post_init__(self) -> None:
        if not all(math.isfinite(x) and x >= 0 for x in (self.time_s, self.state_bytes, self.activation_bytes)):
            raise ValueError(f"stage option {self.label!r}: time and bytes must be finite and >= 0")

    def fits(self, in_flight: int, budget_bytes: float) -> bool:
        return self.state_bytes + self.activation_bytes * in_flight <= budget_bytes


Boundary = Callable[[int, Submesh, Submesh], float]  # (last layer of the sender, sender, receiver) -> s
Options = dict[tuple[int, int, int], tuple[StageOption, ...]]  # (first, last, submesh index) -> options
SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True, kw_only=True)
class OptionArrays:
    """Every option at once, indexed ``[first, last, submesh, option]``; ``inf`` time where none.

    The fast form of :class:`StageCosts` for callers that compose options by arithmetic
    (:mod:`planner.inter.search`); the chosen option's ``label`` is its index.
    """

    time_s: np.ndarray
    state_bytes: np.ndarray
    activation_bytes: np.ndarray


class StageCosts(Protocol):
    def options(self, first: int, last: int, submesh: Submesh) -> Sequence[StageOption]:
        """The ways to run layers ``first..last`` (inclusive) on ``submesh``; empty if none."""
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedStage:
    first: int
    last: int
    submesh: Submesh
    option: StageOption
    time_s: float  # option.time_s plus the boundary to the next stage


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """The stages; ``bubble_fraction = 1 − B·Σ t_s / (S·T)``, the idle share of the S stage groups' time."""

    stages: tuple[PlannedStage, ...]
    step_time_s: float
    max_stage_s: float
    bubble_fraction: float
    num_candidates_tried: int  # DP runs, one per t_max tried
    dp_s: float  # seconds in this module, not in costs.options or boundary_s


@dataclass(frozen=True, kw_only=True)
class _Tables:
    meshes: tuple[Submesh, ...]
    sizes: np.ndarray  # (J,) units per submesh (a unit: the submeshes' common divisor of devices)
    arrays: OptionArrays
    labels: Options | None  # the StageCosts' own options, when given as a protocol
    times: np.ndarray  # (C, L, L, J) τ_c(k, i, j), inf where nothing fits
    boundary: np.ndarray  # (L−1, J, J) b(i, j, j')
    order: np.ndarray  # (L−1, J, J) j' sorted by b(i, j, ·)
    sorted_boundary: np.ndarray  # (L−1, J, J) b(i, j, order[i, j, ·])
    open_class: bool  # class C−1 holds ≥ C stages
    flight_all: bool = False  # GPipe: every microbatch in flight in every stage
    num_devices: int  # in units
    num_microbatches: int
    budget: float


@dataclass(frozen=True, kw_only=True)
class _Run:
    """One DP run's plan: stages (first, last, submesh index, stage time), its DP sum and true max."""

    path: tuple[tuple[int, int, int, float], ...]
    sigma: float
    max_s: float

    def latency(self, num_microbatches: int) -> float:
        return math.fsum(stage[3] for stage in self.path) + (num_microbatches - 1) * self.max_s


def is_large(cluster: Cluster) -> bool:
    """Past :data:`WHOLE_NODE_LIMIT` nodes: whole-node submeshes, and the Megatron grid tried as at scale
    (:func:`planner.baselines.handwritten_plan.megatron_at_scale`)."""
    return cluster.num_nodes > WHOLE_NODE_LIMIT


def submeshes(num_nodes: int, devices_per_node: int) -> list[Submesh]:
    """(1,1), (1,2), (1,4), … (powers of two dividing M, so blocks pack into nodes), (1,M), then (n,M).

    Past :data:`WHOLE_NODE_LIMIT` nodes, whole nodes only, and ``n`` only among the divisors of ``N``
    (so every uniform pipeline is there, and any mix of them): Alpa's every ``n`` makes ``O(N)`` submeshes
    and an ``O(N²)`` DP table per layer pair; this keeps ``O(d(N))`` (16 for 384 nodes) and a DP over
    nodes (:func:`solve_stages` counts devices in units of the submeshes' common divisor)."""
    if num_nodes < 1 or devices_per_node < 1:
        raise ValueError(f"need at least one node and one device per node, got {num_nodes}x{devices_per_node}")
    if num_nodes > WHOLE_NODE_LIMIT:
        sizes = [n for n in range(1, num_nodes + 1) if num_nodes % n == 0]
        return [Submesh(num_nodes=n, devices_per_node=devices_per_node) for n in sizes]
    widths = [1 << a for a in range(devices_per_node.bit_length()) if devices_per_node % (1 << a) == 0]
    widths = [w for w in widths if w < devices_per_node] + [devices_per_node]
    row = [Submesh(num_nodes=1, devices_per_node=w) for w in widths]
    return row + [Submesh(num_nodes=n, devices_per_node=devices_per_node) for n in range(2, num_nodes + 1)]


def solve_stages(
    *,
    num_layers: int,
    num_nodes: int,
    devices_per_node: int,
    num_microbatches: int,
    costs: StageCosts | OptionArrays,
    memory_budget_bytes: float,
    max_stages: int | None = None,
    boundary_s: Boundary | None = None,
    early_stop: bool = True,
    schedule: str = "1f1b",
) -> StagePlan:
    """The stages, submeshes and options of least pipeline latency; AutoplanError if no slicing fits.

    ``schedule`` sets the microbatches in flight: ``min(S − s, B)`` for 1F1B, ``B`` for GPipe."""
    if min(num_layers, num_microbatches, 1 if max_stages is None else max_stages) < 1:
        raise ValueError(f"need layers, microbatches, max_stages >= 1: {num_layers, num_microbatches, max_stages}")
    assert schedule in SCHEDULES, schedule
    meshes = tuple(submeshes(num_nodes, devices_per_node))
    labels = None
    if not isinstance(costs, OptionArrays):
        labels = {
            (k, i, j): tuple(costs.options(k, i, mesh))
            for k in range(num_layers)
            for i in range(k, num_layers)
            for j, mesh in enumerate(meshes)
        }
        costs = _arrays(labels, num_layers, len(meshes))
    boundary = _boundary(boundary_s, num_layers, meshes)
    queried = time.perf_counter()
    natural = min(num_layers, num_nodes * devices_per_node)
    stage_limit = natural if max_stages is None else min(natural, max_stages)
    if schedule == "gpipe":
        times, open_class = _fitting_times(costs, [num_microbatches], memory_budget_bytes), True
    else:
        flights = range(1, min(num_microbatches, stage_limit) + 1)
        times, open_class = _classes(
            _fitting_times(costs, flights, memory_budget_bytes), stage_limit, exact=stage_limit < natural
        )
    order = np.argsort(boundary, axis=2, kind="stable")
    unit = math.gcd(num_nodes * devices_per_node, *(mesh.size for mesh in meshes))  # devices are counted in units
    tables = _Tables(
        meshes=meshes,
        sizes=np.array([mesh.size // unit for mesh in meshes]),
        arrays=costs,
        labels=labels,
        times=times,
        boundary=boundary,
        order=order,
        sorted_boundary=np.take_along_axis(boundary, order, axis=2),
        open_class=open_class,
        flight_all=schedule == "gpipe",
        num_devices=num_nodes * devices_per_node // unit,
        num_microbatches=num_microbatches,
        budget=memory_budget_bytes,
    )
    best, tried = _search(tables, early_stop)
    if best is None:
        gib = memory_budget_bytes / GIB
        raise AutoplanError(f"no pipeline of at most {stage_limit} stages fits in {gib:.3g} GiB per device")
    return _plan(tables, best, tried, time.perf_counter() - queried)


def _boundary(boundary_s: Boundary | None, num_layers: int, meshes: tuple[Submesh, ...]) -> np.ndarray:
    """``b(i, j, j')`` for every layer ``i < L − 1`` ending a stage and pair of submeshes; zeros if none."""
    out = np.zeros((max(num_layers - 1, 0), len(meshes), len(meshes)))
    if boundary_s is not None:
        for i in range(num_layers - 1):
            out[i] = [[boundary_s(i, sender, receiver) for receiver in meshes] for sender in meshes]
    if not (np.isfinite(out).all() and (out >= 0).all()):
        raise ValueError("boundary_s must return finite seconds >= 0")
    return out


def _arrays(options: Options, num_layers: int, num_meshes: int) -> OptionArrays:
    width = max((len(found) for found in options.values()), default=1) or 1
    shape = (num_layers, num_layers, num_meshes, width)
    times, state, activation = np.full(shape, np.inf), np.zeros(shape), np.zeros(shape)
    for (k, i, j), found in options.items():
        for o, option in enumerate(found):
            times[k, i, j, o], state[k, i, j, o] = option.time_s, option.state_bytes
            activation[k, i, j, o] = option.activation_bytes
    return OptionArrays(time_s=times, state_bytes=state, activation_bytes=activation)


def _fitting_times(arrays: OptionArrays, flights: Sequence[int], budget: float) -> np.ndarray:
    """``τ_f(k, i, j)`` for each ``f`` of ``flights``: the fastest option fitting with f microbatches in flight."""
    times, state, activation = arrays.time_s, arrays.state_bytes, arrays.activation_bytes
    return np.stack([np.where(state + activation * f <= budget, times, np.inf).min(axis=-1) for f in flights])


def _classes(fitting: np.ndarray, stage_limit: int, *, exact: bool) -> tuple[np.ndarray, bool]:
    """(times per class, whether the last class is open): exact counts 1..stage_limit, or merged from C on."""
    if exact:
        flight = np.minimum(np.arange(1, stage_limit + 1), len(fitting))  # min(s, B), as len = min(B, limit)
        return fitting[flight - 1], False
    count = len(fitting)
    while count > 1 and np.array_equal(fitting[count - 2], fitting[count - 1]):
        count -= 1
    return fitting[:count], True


def _search(tables: _Tables, early_stop: bool) -> tuple[_Run | None, int]:
    """The run of least recomputed latency and the number of DP runs (see the module docstring)."""
    prefix, batches = _Scratch(tables), tables.num_microbatches
    if not early_stop:
        runs = [_dp(tables, float(t), prefix) for t in _candidates(tables, _UNBOUNDED)]
        found = [run for run in runs if run is not None]
        return min(found, key=lambda run: run.latency(batches), default=None), len(runs)
    best = _dp(tables, _UNBOUNDED, prefix)
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


def _candidates(tables: _Tables, below: float) -> np.ndarray:
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

    def __init__(self, tables: _Tables) -> None:
        num_classes, num_layers, _, num_meshes = tables.times.shape
        shape = (num_classes, max(num_layers - 1, 0), num_meshes, num_meshes + 1, tables.num_devices + 1)
        self.prefix = np.full(shape, np.inf)
        self.rows = self.prefix.reshape(-1, shape[-1])
        self.first_row = (num_meshes + 1) * np.arange(math.prod(shape[:3])).reshape(shape[:3])
        self.value = np.empty((num_classes, num_layers, num_meshes, tables.num_devices + 1))  # F, refilled per run


def _dp(tables: _Tables, t_max: float, scratch: _Scratch) -> _Run | None:
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


def _step(tables: _Tables, t_max: float, scratch: _Scratch, k: int) -> np.ndarray:
    """``[c, i − k, j, d]``: first stage ``k..i`` (``i < L − 1``) plus the best admissible rest, from ``P``."""
    end = tables.times.shape[1] - 1
    tau = tables.times[:, k, k:end]  # (C, i, j)
    count = (tau[..., None] + tables.sorted_boundary[k:end] <= t_max).sum(axis=-1)  # admissible j'
    total = np.take(scratch.rows, scratch.first_row[:, k:end] + count, axis=0)  # (C, i, j, d)
    return np.add(total, tau[..., None], out=total)


def _final(tables: _Tables, t_max: float, value: np.ndarray, k: int) -> None:
    """A last stage ``k..L−1`` (one microbatch in flight, no boundary), in class 0."""
    tau, meshes = tables.times[0, k, -1], np.arange(len(tables.sizes))
    better = (tau <= t_max) & (tau < value[0, k, meshes, tables.sizes])
    value[0, k, meshes[better], tables.sizes[better]] = tau[better]


def _prefix(tables: _Tables, after: np.ndarray, out: np.ndarray, i: int) -> None:
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


def _trace(tables: _Tables, t_max: float, value: np.ndarray, scratch: _Scratch) -> _Run | None:
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
    return _Run(path=tuple(path), sigma=sigma, max_s=max(stage[3] for stage in path))


def _last_layer(tables: _Tables, t_max: float, scratch: _Scratch, c: int, k: int, j: int, devices: int) -> int:
    """The ``i`` behind ``F(c, k, devices, j)``: :func:`_step`'s argmin, or ``L − 1`` where :func:`_final` won."""
    last = tables.times.shape[1] - 1
    steps = _step(tables, t_max, scratch, k)[c, :, j, devices] if k < last else np.full(1, np.inf)
    tau = float(tables.times[0, k, last, j])
    final = c == 0 and devices == tables.sizes[j] and tau <= t_max and tau < steps.min()
    return last if final else k + int(np.argmin(steps))


def _follow(
    tables: _Tables, t_max: float, value: np.ndarray, c: int, i: int, j: int, devices: int, tau: float
) -> tuple[float, int, int]:
    """(boundary, class, submesh) of the stage after ``k..i`` on ``j``: the argmin behind ``_prefix``."""
    classes = [c - 1] if c else []
    if tables.open_class and c == len(tables.times) - 1:
        classes.append(c)
    count = int((tau + tables.sorted_boundary[i, j] <= t_max).sum())
    after = [(float(tables.boundary[i, j, n]), cn, int(n)) for cn in classes for n in tables.order[i, j, :count]]
    return min(after, key=lambda found: found[0] + float(value[found[1], i + 1, found[2], devices]))


def _chosen(tables: _Tables, first: int, last: int, j: int, in_flight: int) -> StageOption:
    """The fastest option of a stage that fits with ``in_flight`` microbatches."""
    arrays = tables.arrays
    state, activation = arrays.state_bytes[first, last, j], arrays.activation_bytes[first, last, j]
    times = np.where(state + activation * in_flight <= tables.budget, arrays.time_s[first, last, j], np.inf)
    o = int(np.argmin(times))
    if tables.labels is not None:
        return tables.labels[first, last, j][o]
    return StageOption(
        time_s=float(times[o]), state_bytes=float(state[o]), activation_bytes=float(activation[o]), label=o
    )


def _plan(tables: _Tables, run: _Run, tried: int, dp_s: float) -> StagePlan:
    """Options for the true in-flight counts, stage times and the latency recomputed in Python."""
    count, batches, stages = len(run.path), tables.num_microbatches, []
    for s, (first, last, j, _) in enumerate(run.path):
        option = _chosen(tables, first, last, j, batches if tables.flight_all else min(count - s, batches))
        boundary = float(tables.boundary[last, j, run.path[s + 1][2]]) if s < count - 1 else 0.0
        mesh, time_s = tables.meshes[j], option.time_s + boundary
        stages.append(PlannedStage(first=first, last=last, submesh=mesh, option=option, time_s=time_s))
    total, longest = math.fsum(stage.time_s for stage in stages), max(stage.time_s for stage in stages)
    step = total + (batches - 1) * longest
    bubble = 1.0 - batches * total / (count * step) if step > 0 else 0.0
    return StagePlan(
        stages=tuple(stages),
        step_time_s=step,
        max_stage_s=longest,
        bubble_fraction=bubble,
        num_candidates_tried=tried,
        dp_s=dp_s,
    )
