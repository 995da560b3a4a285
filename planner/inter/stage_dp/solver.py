"""Slice layers into pipeline stages, each on a submesh: the inter-operator DP of Alpa §5, exact.

``L`` layers, ``N`` nodes of ``M`` devices, ``D = N·M``, ``B`` microbatches, submeshes ``j`` (:func:`submeshes`).
A plan is ``S ≥ 1`` contiguous stages ``k_s..i_s`` on submeshes ``j_s`` with ``Σ_s |j_s| = D`` (all devices
used, as in Alpa), each running one option ``o_s`` of ``costs.options(k_s, i_s, j_s)``. With ``b(i, j, j')``
the optional ``boundary_s`` (p2p of activations and gradients to the next stage, charged to the sender)::

    t_s = o_s.time_s + b(i_s, j_s, j_{s+1})   (none after the last stage)                       (_plan)
    T   = Σ_s t_s + (B − 1)·max_s t_s          (Alpa's pipeline latency)                          (_plan)
    o_s.state_bytes + max(o_s.activation_bytes·f + o_s.peak_extra, o_s.sync) ≤ budget,  f = min(S − s, B)
                                                (1F1B in flight; f = B for GPipe: one class)   (_fitting_times)

``peak_extra``: what one microbatch holds at its peak beyond what it keeps; ``sync``: the gradient buckets' copy
at the end of the last backward (:meth:`OptionArrays.memory_bytes`; both 0 for a :class:`StageOption`).

Only the memory check sees a stage's position, through ``f = min(S − s, B)``, so the fastest fitting
option ``τ_f(k, i, j)`` beats the others of its span, submesh and ``f``: lower sum and max alike.
``τ_f`` stops changing at some ``f = C ≤ B`` (:func:`_classes`): class ``c < C − 1`` holds sub-pipelines
of exactly ``c + 1`` stages, class ``C − 1`` those of ``≥ C`` (followed by class ``C − 2`` or itself). With
ample memory ``C = 1``; a ``max_stages`` below ``min(L, D)`` makes every class exact instead.

The DP at one bound ``t_max``, its exactness and the search over bounds: :mod:`planner.inter.stage_dp.bound_search`
(:func:`~planner.inter.stage_dp.bound_search.search_bounds`); :func:`solve_stages` builds its tables and reads the
plan back (:func:`_plan`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cost_models.cluster import Cluster
from cost_models.units import GIB
from planner.errors import AutoplanError
from planner.inter.stage_dp.bound_search import DpRun, DpTables, search_bounds
from planner.inter.stage_dp.device_blocks import Submesh
from planner.plan.schedules import Schedule

WHOLE_NODE_LIMIT = 32  # nodes; past it submeshes are whole nodes dividing the cluster (:func:`submeshes`)


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
SCHEDULES = (Schedule.ONE_F_ONE_B, Schedule.GPIPE)


@dataclass(frozen=True, kw_only=True)
class OptionArrays:
    """Every option at once, indexed ``[first, last, submesh, option]``; ``inf`` time where none.

    The fast form of :class:`StageCosts` for callers that compose options by arithmetic
    (:mod:`planner.inter.search`); the chosen option's ``label`` is its index.
    """

    time_s: np.ndarray
    state_bytes: np.ndarray
    activation_bytes: np.ndarray
    peak_extra_bytes: np.ndarray | None = None  # one microbatch's peak beyond what it keeps (None: 0)
    sync_bytes: np.ndarray | None = None  # the gradient buckets' copy at the end of the last backward (None: 0)

    def memory_bytes(self, in_flight: int | np.ndarray, index: tuple = ()) -> np.ndarray:
        """Bytes per device of the options at ``index`` with ``in_flight`` microbatches in flight (module
        docstring): state + max(activations · in flight + peak extra, sync)."""
        during = self.activation_bytes[index] * in_flight
        if self.peak_extra_bytes is not None:
            during = during + self.peak_extra_bytes[index]
        if self.sync_bytes is not None:
            during = np.maximum(during, self.sync_bytes[index])
        return self.state_bytes[index] + during


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
    inputs = _DpInputs(
        meshes=meshes,
        arrays=costs,
        labels=labels,
        boundary=_boundary(boundary_s, num_layers, meshes),
        flight_all=schedule == Schedule.GPIPE,
        num_microbatches=num_microbatches,
        budget=memory_budget_bytes,
    )
    queried = time.perf_counter()
    natural = min(num_layers, num_nodes * devices_per_node)
    stage_limit = natural if max_stages is None else min(natural, max_stages)
    tables = _dp_tables(inputs, num_devices=num_nodes * devices_per_node, stage_limit=stage_limit, natural=natural)
    best, tried = search_bounds(tables, early_stop)
    if best is None:
        gib = memory_budget_bytes / GIB
        raise AutoplanError(f"no pipeline of at most {stage_limit} stages fits in {gib:.3g} GiB per device")
    return _plan(inputs, best, tried, time.perf_counter() - queried)


@dataclass(frozen=True, kw_only=True)
class _DpInputs:
    """The DP's inputs: the submeshes, every option, the boundaries, the schedule's flight and the budget; what picks
    each stage's option once the DP has found the stages (:func:`_chosen`)."""

    meshes: tuple[Submesh, ...]
    arrays: OptionArrays
    labels: Options | None  # the StageCosts' own options, when given as a protocol
    boundary: np.ndarray  # (L−1, J, J) b(i, j, j')
    flight_all: bool  # GPipe: every microbatch in flight in every stage
    num_microbatches: int
    budget: float


def _dp_tables(inputs: _DpInputs, *, num_devices: int, stage_limit: int, natural: int) -> DpTables:
    """The DP's tables: ``τ_c`` per class (:func:`_classes`; GPipe: one class, every microbatch in flight), the
    boundaries sorted per sender, and devices counted in units of the submeshes' common divisor."""
    m, budget, boundary = inputs.num_microbatches, inputs.budget, inputs.boundary
    if inputs.flight_all:
        times, open_class = _fitting_times(inputs.arrays, [m], budget), True
    else:
        flights = range(1, min(m, stage_limit) + 1)
        fitting = _fitting_times(inputs.arrays, flights, budget)
        times, open_class = _classes(fitting, stage_limit, exact=stage_limit < natural)
    order = np.argsort(boundary, axis=2, kind="stable")
    unit = math.gcd(num_devices, *(mesh.size for mesh in inputs.meshes))  # devices are counted in units
    return DpTables(
        sizes=np.array([mesh.size // unit for mesh in inputs.meshes]),
        times=times,
        boundary=boundary,
        order=order,
        sorted_boundary=np.take_along_axis(boundary, order, axis=2),
        open_class=open_class,
        num_devices=num_devices // unit,
        num_microbatches=m,
    )


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
    times = arrays.time_s
    return np.stack([np.where(arrays.memory_bytes(f) <= budget, times, np.inf).min(axis=-1) for f in flights])


def _classes(fitting: np.ndarray, stage_limit: int, *, exact: bool) -> tuple[np.ndarray, bool]:
    """(times per class, whether the last class is open): exact counts 1..stage_limit, or merged from C on."""
    if exact:
        flight = np.minimum(np.arange(1, stage_limit + 1), len(fitting))  # min(s, B), as len = min(B, limit)
        return fitting[flight - 1], False
    count = len(fitting)
    while count > 1 and np.array_equal(fitting[count - 2], fitting[count - 1]):
        count -= 1
    return fitting[:count], True


def _chosen(tables: _DpInputs, first: int, last: int, j: int, in_flight: int) -> StageOption:
    """The fastest option of a stage that fits with ``in_flight`` microbatches."""
    arrays = tables.arrays
    state, activation = arrays.state_bytes[first, last, j], arrays.activation_bytes[first, last, j]
    memory = arrays.memory_bytes(in_flight, (first, last, j))
    times = np.where(memory <= tables.budget, arrays.time_s[first, last, j], np.inf)
    o = int(np.argmin(times))
    if tables.labels is not None:
        return tables.labels[first, last, j][o]
    return StageOption(
        time_s=float(times[o]), state_bytes=float(state[o]), activation_bytes=float(activation[o]), label=o
    )


def _plan(tables: _DpInputs, run: DpRun, tried: int, dp_s: float) -> StagePlan:
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
