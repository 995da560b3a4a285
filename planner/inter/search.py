"""The two-level search: pipeline stages by DP over layer options from the intra-op problem (Alpa §5).

For each microbatch count ``m`` (:func:`microbatch_counts`), at microbatch size ``b = B/m``
(:class:`planner.ir.rebatch.MicrobatchGraphs`):

1. Layers ``0..L−1`` (:func:`layering`): repeated blocks from module paths, or Alpa's
   clustering; identical layers share a *kind* and are solved once.
2. Submeshes ``j`` (:func:`planner.inter.stage_dp.solver.submeshes`) and their logical meshes ``q``
   (:func:`planner.intra.logical_meshes.logical_meshes`); per (kind, j, q) a
   :class:`~planner.inter.layer_costs.LayerTable` of slots ``w`` (:class:`LayerTables`).
3. Span options by prefix sums over layers (:func:`option_arrays`)::

       time(k, i, j, (q, w)) = Σ_{ℓ=k..i} time_w(kind ℓ, j, q)     (and state, activation, sync bytes)
       peak_extra(k, i, j, (q, w)) = max_{ℓ=k..i} peak_extra_w(kind ℓ, j, q)                  (_span_maxima)

   ``--remat off|attention|full`` (``on``: full) keeps only the slots of that recomputation, ``--zero z`` those
   of ZeRO level ``z`` (level 1 on the sharded stages when ``z`` is 2 or 3: those run under FSDP only, so the
   FSDP slots stand only for one stage of every layer on every device, a data-parallel plan).
4. Boundary between consecutive stages ``b(i, j, j')``: the activation crossing after layer ``i`` and its
   gradient between submeshes ``j`` and ``j'`` (:func:`planner.inter.stage_dp.boundaries.boundary_table`), built
   once per count and carried with it (:attr:`PipelineChoice.boundary_s`) to every candidate priced at that count.
5. :func:`planner.inter.stage_dp.solver.solve_stages` picks stages, submeshes and options for the least
   ``Σ t_s + (m − 1)·max t_s`` under 1F1B (or GPipe) memory.

With ``--jobs N`` the layer tables of each count (:meth:`LayerTables.prefetch`) and the counts' DPs
(independent of one another) run over forked processes (:mod:`planner.inter.forked`); the plan is the
same (a test checks it).

The best ``m`` wins; its plan is re-priced on whole stages by :mod:`planner.inter.pricing`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from planner.costing.setup import CostSetup
from planner.errors import AutoplanError
from planner.inter.forked import fork_map
from planner.inter.layer_costs import (
    FSDP_LEVELS,
    ROWS,
    SLOTS,
    LayerTable,
    layer_table,
    loss_and_output_bytes,
    with_loss,
)
from planner.inter.stage_dp.boundaries import BoundaryTable, boundary_table
from planner.inter.stage_dp.device_blocks import Submesh
from planner.inter.stage_dp.solver import OptionArrays, StagePlan, solve_stages, submeshes
from planner.intra.logical_meshes import logical_meshes
from planner.intra.stage_problem import IntraOpOptions
from planner.ir.graph import OpGraph, subgraph
from planner.ir.layers import collapse_identical_layers, graph_layers
from planner.ir.rebatch import MicrobatchGraphs
from planner.options import PlanOptions, RematChoice, ScheduleChoice, ZeroChoice
from planner.plan import ZERO_LEVELS
from planner.plan.schedules import Schedule
from planner.sharding.specs import StageMesh

MAX_AUTO_MICROBATCHES = 64
MAX_LAYERS = 32
Progress = Callable[[str, int, int], None]  # (what, done, total)


@dataclass(frozen=True, kw_only=True)
class Layering:
    layers: tuple[tuple[str, ...], ...]  # node names per layer, in order
    kinds: tuple[int, ...]  # per layer, the layer whose table it uses (the first of its run)


def layering(graph: OpGraph, *, max_layers: int = MAX_LAYERS) -> Layering:
    """Layers of :func:`planner.ir.layers.graph_layers`; above ``max_layers``, consecutive identical layers
    are grouped ``g = ⌈L / max_layers⌉`` at a time (Alpa also plans over a few coarse layers)."""
    layers = [tuple(names) for names in graph_layers(graph)]
    representative = collapse_identical_layers(graph).representative
    shapes = [tuple(representative[name] for name in names) for names in layers]
    if len(layers) > max_layers:
        group = -(-len(layers) // max_layers)
        merged: list[tuple[str, ...]] = []
        merged_shapes: list[tuple[str, ...]] = []
        run_start = 0
        for index in range(len(layers) + 1):
            if index == len(layers) or shapes[index] != shapes[run_start]:
                for first in range(run_start, index, group):
                    last = min(first + group, index)
                    merged.append(tuple(name for names in layers[first:last] for name in names))
                    merged_shapes.append(tuple(name for shape in shapes[first:last] for name in shape))
                run_start = index
        layers, shapes = merged, merged_shapes
    first_of = {}
    kinds = tuple(first_of.setdefault(shape, index) for index, shape in enumerate(shapes))
    return Layering(layers=tuple(layers), kinds=kinds)


def microbatch_counts(batch_size: int, requested: int | None, *, data_degree: int | None = None) -> list[int]:
    """``[requested]`` (it must divide the batch), else the powers of two dividing it, up to 64; with a
    fixed ``data_degree`` ``d`` (``--degrees``) also ``m = B/(d·r)`` for ``r = 1, 2, 4, …`` rows per replica
    (ascending): a deep pipeline (GPT-1T at pipeline 64, Megatron's 530B at pipeline 35) fits only with
    hundreds of microbatches, and Megatron runs one row per replica per microbatch."""
    if requested is not None:
        if requested < 1 or batch_size % requested:
            raise AutoplanError(f"--microbatches {requested} must be a positive divisor of the batch size {batch_size}")
        return [requested]
    counts, m = [], 1
    while m <= min(batch_size, MAX_AUTO_MICROBATCHES) and batch_size % m == 0:
        counts.append(m)
        m *= 2
    if data_degree is not None and batch_size % data_degree == 0:
        per_replica, rows = batch_size // data_degree, 1
        while per_replica % rows == 0 and per_replica // rows > MAX_AUTO_MICROBATCHES:
            counts.append(per_replica // rows)
            rows *= 2
    return sorted(set(counts))


def canonical_mesh(setup: CostSetup, submesh: Submesh, shape: tuple[int, ...]) -> StageMesh:
    """The submesh on ranks ``0..|j|−1``: where it sits does not change its links."""
    devices = tuple(range(submesh.size))
    return StageMesh(
        cluster=setup.cluster, devices=devices, mesh_shape=shape, activation_itemsize=setup.activation_itemsize
    )


class LayerTables:
    """:class:`LayerTable` per (kind, submesh, logical mesh, m), built once; counts the solves.

    ``sources``: the slots' sources to solve (:data:`planner.inter.layer_costs.SOURCES`; None: all).
    A hand-written method needs only its own (``megatron``), which skips the Lagrangian solves."""

    def __init__(self, setup: CostSetup, options: PlanOptions, *, sources: tuple[str, ...] | None = None) -> None:
        self.setup, self.options, self.sources = setup, options, sources
        self._tables: dict[tuple, LayerTable] = {}
        self._meshes: dict[tuple, StageMesh] = {}
        self.num_solves = 0

    def get(
        self, graph: OpGraph, layers: Layering, kind: int, submesh: Submesh, shape: tuple[int, ...], m: int
    ) -> LayerTable:
        key = (kind, submesh, shape, m)
        if key not in self._tables:
            self._tables[key] = self._build(graph, layers, key)
            self.num_solves += 1
        return self._tables[key]

    def _build(self, graph: OpGraph, layers: Layering, key: tuple) -> LayerTable:
        kind, submesh, shape, m = key
        mesh_key = (submesh, shape)
        if mesh_key not in self._meshes:
            self._meshes[mesh_key] = canonical_mesh(self.setup, submesh, shape)
        intra = IntraOpOptions(
            num_microbatches=m,
            time_limit_s=self.options.ilp_time_limit_s,  # ZeRO: per slot
            sequence_parallel=self.options.space != "alpa",
        )
        part = subgraph(graph, list(layers.layers[kind]))
        mesh = self._meshes[mesh_key]
        table = layer_table(part, self.setup, mesh, options=intra, sources=self.sources)
        held = loss_and_output_bytes(
            graph,
            layers.layers[kind],
            self.setup,
            num_devices=len(mesh.devices),
            mesh_shape=tuple(mesh.mesh_shape),
            num_microbatches=m,
        )
        return with_loss(table, held)

    def prefetch(
        self, graph: OpGraph, layers: Layering, keys: list[tuple], *, progress: Callable[[int, int], None] | None = None
    ) -> None:
        """Build the missing tables of ``keys`` ((kind, submesh, shape, m)) over ``options.jobs`` processes."""
        missing = [key for key in dict.fromkeys(keys) if key not in self._tables]
        if not missing:
            return
        report = None if progress is None else (lambda done: progress(done, len(missing)))
        built = fork_map(lambda key: self._build(graph, layers, key), missing, jobs=self.options.jobs, on_done=report)
        self._tables.update(zip(missing, built, strict=True))
        self.num_solves += len(missing)


MeshChoices = list[tuple[Submesh, list[tuple[int, ...]]]]


def mesh_choices(setup: CostSetup) -> MeshChoices:
    cluster = setup.cluster
    return [
        (submesh, logical_meshes(submesh.size, cluster.devices_per_node))
        for submesh in submeshes(cluster.num_nodes, cluster.devices_per_node)
    ]


def allowed_slots(remat: str, zero: str | int = "auto") -> np.ndarray:
    """The slots ``--remat`` and ``--zero`` allow (a mask over :data:`SLOTS`)."""
    if remat not in tuple(RematChoice):
        raise AutoplanError(f"--remat must be one of {', '.join(RematChoice)}, got {remat!r}")
    if str(zero) not in tuple(ZeroChoice):
        raise AutoplanError(f"--zero must be one of {', '.join(ZeroChoice)}, got {zero!r}")
    kinds = {
        "auto": ("none", "attention", "full"),
        "on": ("full",),
        "off": ("none",),
        "off-or-full": ("none", "full"),
    }.get(remat, (remat,))
    # --zero N: every stage at level N, so at 2 and 3 only data-parallel layouts (FSDP) remain (method_options)
    levels = ZERO_LEVELS if zero == "auto" else {int(zero)}
    return np.array([slot_remat in kinds and slot_zero in levels for _, slot_remat, slot_zero in SLOTS])


@dataclass(frozen=True, kw_only=True)
class SpanOptions:
    arrays: OptionArrays  # [first, last, j, option] with j indexing ``meshes``
    labels: tuple[tuple[tuple[tuple[int, ...], int], ...], ...]  # per submesh, option index -> (mesh shape, slot)
    meshes: tuple[Submesh, ...]

    def index(self, submesh: Submesh) -> int:
        return self.meshes.index(submesh)


def option_arrays(
    graph: OpGraph,
    layers: Layering,
    tables: LayerTables,
    m: int,
    *,
    choices: MeshChoices | None = None,
    progress: Progress | None = None,
) -> SpanOptions:
    """Span options for every (first, last, submesh) by prefix sums of per-layer slots; over ``choices``
    (submeshes and their logical meshes) when given, else over every one of :func:`mesh_choices`."""
    choices = mesh_choices(tables.setup) if choices is None else choices
    num_layers, slots = len(layers.layers), len(SLOTS)
    width = max(len(shapes) for _, shapes in choices) * slots
    shape = (num_layers, num_layers, len(choices), width)
    times, state, activation = np.full(shape, np.inf), np.zeros(shape), np.zeros(shape)
    extra, sync = np.zeros(shape), np.zeros(shape)
    allowed = allowed_slots(tables.options.remat, tables.options.zero)
    upper = np.triu(np.ones((num_layers, num_layers), dtype=bool))
    fsdp = np.array([zero in FSDP_LEVELS for _, _, zero in SLOTS])  # data-parallel plans only: one stage, every device
    labels = []
    keys = [
        (kind, submesh, q, m) for submesh, shapes in choices for q in shapes for kind in dict.fromkeys(layers.kinds)
    ]

    def report(done: int, total: int) -> None:
        if progress is not None:
            progress(f"layer options, {m} microbatches", done, total)

    tables.prefetch(graph, layers, keys, progress=report)
    for j, (submesh, shapes) in enumerate(choices):
        labels.append(tuple((q, w) for q in shapes for w in range(slots)))
        for index, q in enumerate(shapes):
            per_layer = np.stack([tables.get(graph, layers, kind, submesh, q, m).arrays() for kind in layers.kinds])
            per_layer[:, 0, ~allowed] = np.inf
            cumulative = np.concatenate([np.zeros((1, len(ROWS), slots)), np.cumsum(per_layer, axis=0)])
            with np.errstate(invalid="ignore"):  # inf − inf where a slot is empty: set to inf below
                spans = cumulative[None, 1:] - cumulative[:-1, None]  # [k, i] = Σ_{k..i}, valid for k ≤ i
            columns = slice(index * slots, (index + 1) * slots)
            times[:, :, j, columns] = np.where(upper[..., None], spans[:, :, 0], np.inf)
            if submesh.size != tables.setup.cluster.num_devices or q != (submesh.size,):
                times[:, :, j, columns][:, :, fsdp] = np.inf
            else:
                times[1:, :, j, columns][:, :, fsdp] = np.inf
                times[:, :-1, j, columns][:, :, fsdp] = np.inf
            state[:, :, j, columns], activation[:, :, j, columns] = spans[:, :, 1], spans[:, :, 2]
            sync[:, :, j, columns], extra[:, :, j, columns] = spans[:, :, 4], _span_maxima(per_layer[:, 3])
    times[~np.isfinite(times)] = np.inf  # inf − inf in the prefix sums
    return SpanOptions(
        arrays=OptionArrays(
            time_s=times, state_bytes=state, activation_bytes=activation, peak_extra_bytes=extra, sync_bytes=sync
        ),
        labels=tuple(labels),
        meshes=tuple(submesh for submesh, _ in choices),
    )


def _span_maxima(per_layer: np.ndarray) -> np.ndarray:
    """``[k, i, slot]`` = the largest of ``per_layer[k..i, slot]`` for ``k ≤ i`` (0 below the diagonal): a stage's
    peak beyond what it keeps is the largest of its layers'."""
    count = len(per_layer)
    out = np.zeros((count, *per_layer.shape))
    for first in range(count):
        out[first, first:] = np.maximum.accumulate(per_layer[first:], axis=0)
    return out


@dataclass(frozen=True, kw_only=True)
class PipelineChoice:
    num_microbatches: int
    schedule: str
    graph: OpGraph  # at the microbatch size
    layers: Layering
    stage_plan: StagePlan | None  # None: the DP found nothing that fits at this count
    spans: SpanOptions
    boundary_s: BoundaryTable  # boundary_table of graph and layers, for every candidate of this count
    failure: str = ""
    rows: int = 0  # the microbatch's rows (batch / m): a data-parallel degree must divide them (0: not checked)


@dataclass(frozen=True, kw_only=True)
class PipelineSearch:
    choices: list[PipelineChoice]  # one per microbatch count
    dp_s: float  # wall seconds of the stage DPs (run over ``options.jobs`` processes)


@dataclass(frozen=True, kw_only=True)
class CountLayout:
    """What a microbatch count ``m`` fixes before any option is chosen: the graph at the microbatch size, its layers
    and their boundary table (:func:`count_layout`)."""

    num_microbatches: int
    graph: OpGraph
    layers: Layering
    boundary_s: BoundaryTable
    rows: int  # the microbatch's rows (batch / m)

    def choice(
        self, *, schedule: str, spans: SpanOptions, stage_plan: StagePlan | None = None, failure: str = ""
    ) -> PipelineChoice:
        """This count's :class:`PipelineChoice` under ``schedule`` with its span options and the DP's plan."""
        return PipelineChoice(
            num_microbatches=self.num_microbatches,
            schedule=schedule,
            graph=self.graph,
            layers=self.layers,
            stage_plan=stage_plan,
            spans=spans,
            boundary_s=self.boundary_s,
            failure=failure,
            rows=self.rows,
        )


def count_layout(
    graphs: MicrobatchGraphs, m: int, setup: CostSetup, *, max_layers: int | None = MAX_LAYERS
) -> CountLayout:
    """The graph of ``m`` microbatches, its :func:`layering` (``max_layers`` None: layers not grouped) and the
    boundary table between its layers."""
    graph = graphs.at(graphs.batch_size // m)
    layers = layering(graph, max_layers=len(graph.nodes) if max_layers is None else max_layers)
    boundary = boundary_table(graph, layers.layers, setup)
    return CountLayout(num_microbatches=m, graph=graph, layers=layers, boundary_s=boundary, rows=graphs.batch_size // m)


def pipeline_schedule(options: PlanOptions) -> Schedule:
    """The schedule a searched pipeline is priced under: GPipe when asked, else 1F1B (the same latency, and 1F1B
    never needs more memory)."""
    return Schedule.GPIPE if options.schedule == ScheduleChoice.GPIPE else Schedule.ONE_F_ONE_B


def search_pipeline(
    graphs: MicrobatchGraphs,
    setup: CostSetup,
    tables: LayerTables,
    *,
    options: PlanOptions,
    progress: Progress | None = None,
) -> PipelineSearch:
    """Per microbatch count, the layer options and the DP's best plan (None where nothing fits). The
    counts' DPs are independent: with ``options.jobs > 1`` they run over forked processes."""
    schedule, cluster, inputs = pipeline_schedule(options), setup.cluster, []
    for m in microbatch_counts(graphs.batch_size, options.microbatches):
        layout = count_layout(graphs, m, setup)
        inputs.append((layout, option_arrays(layout.graph, layout.layers, tables, m, progress=progress)))

    def solve(item: tuple[CountLayout, SpanOptions]) -> tuple[StagePlan | None, str]:
        layout, spans = item
        m = layout.num_microbatches
        try:
            return solve_stages(
                num_layers=len(layout.layers.layers),
                num_nodes=cluster.num_nodes,
                devices_per_node=cluster.devices_per_node,
                num_microbatches=m,
                costs=spans.arrays,
                memory_budget_bytes=setup.memory_budget_bytes,
                max_stages=options.max_stages,
                boundary_s=layout.boundary_s,
                schedule=schedule,
            ), ""
        except AutoplanError as error:
            return None, f"{m} microbatches: {error}"

    started = time.perf_counter()
    report = None if progress is None else (lambda done: progress("stage DP", done, len(inputs)))
    solved = fork_map(solve, inputs, jobs=options.jobs, on_done=report, min_items=2)
    choices = [
        layout.choice(schedule=schedule, spans=spans, stage_plan=plan, failure=failure)
        for (layout, spans), (plan, failure) in zip(inputs, solved, strict=True)
    ]
    return PipelineSearch(choices=choices, dp_s=time.perf_counter() - started)
