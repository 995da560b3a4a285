"""The plans engineers write by hand, in the search's own terms and priced by the same model.

* ``megatron`` (:func:`megatron_grid`): every ``(t, p, d)`` with ``t·p·d = D``, ``t`` dividing
  the devices per node: ``p`` stages of equal layer counts, each on ``t·d`` devices as a
  ``(d, t)`` mesh, data parallel over ``d`` and Megatron tensor parallel over ``t``
  (:func:`planner.intra.incumbents.megatron_choice`), with full, selective or no recomputation and with or
  without Megatron's distributed optimizer (ZeRO-1);
* ``uniform-pipeline`` (:func:`uniform_pipelines`): ``p`` stages of equal layer counts on
  equal submeshes, each stage with its best option (any mesh, any slot);
* ``data-parallel``: ``(1, 1, D)`` of the grid: DDP, or FSDP at ZeRO level 1, 2 or 3.

``--degrees T,P,D`` (:meth:`planner.options.PlanOptions.check_cluster`) makes ``megatron`` that one
configuration, as users check their own, still choosing its microbatch count and recomputation.

Each is scored per microbatch count on the span options of :mod:`planner.inter.search`
(:func:`approximate_step_s`: ``Σ t_s + (m − 1)·max t_s``, 1F1B memory), and the best is then
priced exactly like the auto plan (:func:`planner.inter.pricing.price_stages`).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from planner.baselines.method_options import MemoryParts
from planner.costing.setup import CostSetup
from planner.inter.layer_costs import SLOTS, loss_and_output_bytes
from planner.inter.search import MAX_LAYERS, PipelineChoice, allowed_slots, mesh_choices
from planner.inter.stage_pricing import StageSpec
from planner.options import Method, PlanOptions
from planner.plan import ZERO_LEVELS
from planner.plan.schedules import Schedule, in_flight_microbatches

HANDWRITTEN = ("data-parallel", "megatron", "uniform-pipeline")


@dataclass(frozen=True, kw_only=True)
class Candidate:
    method: str
    degrees: tuple[int, int, int]  # (tensor, pipeline, data); 0 where a stage picks its own mesh
    step_time_s: float  # approximate (span options); inf when it does not fit
    memory_bytes: float  # the most a stage holds (span options)
    specs: tuple[StageSpec, ...]
    setting: PipelineChoice


def equal_spans(kinds: tuple[int, ...], count: int) -> list[list[tuple[int, int]]]:
    """The ways to cut ``count`` stages of equal work by hand, distinct: equal layer counts over every layer,
    and, past :data:`planner.inter.search.MAX_LAYERS` layers (a deep model on whole layers: at scale or
    with a deep ``--degrees``), Megatron's cut — the repeated layers (a kind seen more than once, in one
    run) in equal runs, the layers before the run (embeddings) with the first stage and after it (the
    head) with the last. Up to ``MAX_LAYERS`` (grouped layers) the plans are those of equal counts only."""
    cuts = [_cut(0, len(kinds) - 1, len(kinds), count)]
    if len(kinds) <= MAX_LAYERS:
        return cuts
    seen = Counter(kinds)
    repeated = [index for index, kind in enumerate(kinds) if seen[kind] > 1]
    if len(repeated) >= count and len(repeated) == repeated[-1] - repeated[0] + 1:
        megatron = _cut(repeated[0], repeated[-1], len(kinds), count)
        if megatron != cuts[0]:
            cuts.append(megatron)
    return cuts


def _cut(first: int, last: int, num_layers: int, count: int) -> list[tuple[int, int]]:
    """Layers ``first..last`` in ``count`` runs of equal length; the layers outside go to the end runs."""
    bounds = np.linspace(first, last + 1, count + 1).round().astype(int)
    bounds[0], bounds[-1] = 0, num_layers
    return [(int(a), int(b) - 1) for a, b in itertools.pairwise(bounds)]


def approximate_step_s(setting: PipelineChoice, setup: CostSetup, specs: list[StageSpec]) -> float:
    """Latency of fixed stages on the span options; inf if a stage has no option or does not fit."""
    step_s, memory_bytes = approximate(setting, specs)
    return step_s if memory_bytes <= setup.memory_budget_bytes else math.inf


def approximate(setting: PipelineChoice, specs: list[StageSpec]) -> tuple[float, float]:
    """Latency ``Σ t_s + (m − 1)·max t_s`` of fixed stages on the span options and the most bytes a stage holds
    (1F1B's or GPipe's in-flight microbatches); (inf, inf) if a stage has no option."""
    m, count = setting.num_microbatches, len(specs)
    boundary = setting.boundary_s
    times, memory = [], 0.0
    for s, spec in enumerate(specs):
        index = _span_index(setting, spec)
        if index is None:
            return math.inf, math.inf
        state, activations = _stage_memory(setting, index, in_flight=_in_flight(setting, s, count))
        memory = max(memory, state + activations)
        after = boundary(spec.last, spec.submesh, specs[s + 1].submesh) if s < count - 1 else 0.0
        times.append(float(setting.spans.arrays.time_s[index]) + after)
    return math.fsum(times) + (m - 1) * max(times), memory


def _span_index(setting: PipelineChoice, spec: StageSpec) -> tuple[int, int, int, int] | None:
    """Where ``spec``'s option sits in the span arrays; None when it has none (or an infinite time)."""
    if spec.submesh not in setting.spans.meshes:
        return None
    j = setting.spans.index(spec.submesh)
    labels = setting.spans.labels[j]
    if (spec.mesh_shape, spec.slot) not in labels:
        return None
    index = (spec.first, spec.last, j, labels.index((spec.mesh_shape, spec.slot)))
    return index if math.isfinite(setting.spans.arrays.time_s[index]) else None


def _in_flight(setting: PipelineChoice, stage: int, count: int) -> int:
    """Microbatches stage ``stage`` of ``count`` holds at once: all under GPipe, at most ``count − stage`` in 1F1B."""
    return in_flight_microbatches(setting.schedule, num_stages=count, stage=stage, m=setting.num_microbatches)


def _stage_memory(setting: PipelineChoice, index: tuple[int, int, int, int], *, in_flight: int) -> tuple[float, float]:
    """(state, activations) bytes per device of a stage: its weights, gradients and optimizer state, and what its
    ``in_flight`` microbatches hold."""
    arrays = setting.spans.arrays
    state = float(arrays.state_bytes[index])
    return state, float(arrays.memory_bytes(in_flight, index)) - state


def memory_parts(candidate: Candidate, setup: CostSetup) -> MemoryParts | None:
    """The candidate's fullest stage's memory in parts (:class:`planner.baselines.method_options.MemoryParts`), by
    the span options :func:`approximate` reads: the state and the rest (activations; the model outputs and loss a
    stage holds once, :func:`planner.inter.layer_costs.loss_and_output_bytes`, in the options' state, count with
    them, as they grow with the rows). None when a stage has no option."""
    setting, specs, fullest = candidate.setting, candidate.specs, None
    # the last stage's outputs split by rows (planner.plan.stage.loss_row_axes), or whole on each device (1)
    split = setup.loss_rows(specs[-1].mesh_shape, num_microbatches=setting.num_microbatches)
    for s, spec in enumerate(specs):
        index = _span_index(setting, spec)
        if index is None:
            return None
        state, activations = _stage_memory(setting, index, in_flight=_in_flight(setting, s, len(specs)))
        names = [name for layer in setting.layers.layers[spec.first : spec.last + 1] for name in layer]
        outputs = loss_and_output_bytes(
            setting.graph,
            names,
            setup,
            num_devices=spec.submesh.size,
            mesh_shape=spec.mesh_shape,
            num_microbatches=setting.num_microbatches,
        )
        state, activations = state - outputs, activations + outputs
        if fullest is None or state + activations > fullest[0] + fullest[1]:
            fullest = (state, activations, SLOTS[spec.slot][2], outputs if split == 1 else 0.0)
    assert fullest is not None, "a candidate has stages"
    return MemoryParts(
        state_bytes=fullest[0],
        activation_bytes=fullest[1],
        zero=fullest[2],
        data_degree=max(1, candidate.degrees[2]),
        num_microbatches=setting.num_microbatches,
        output_bytes=0.0 if setup.runtime.local_outputs else fullest[3],  # whole on each device (the message says)
        loss_row_split=split,
    )


def _submesh_of(setup: CostSetup, size: int):
    return next((submesh for submesh, _ in mesh_choices(setup) if submesh.size == size), None)


MEGATRON_ZERO = (0, 1)  # Megatron-LM's distributed optimizer is ZeRO-1 (--use-distributed-optimizer)


def _slots(source: str, remat: str, zero: str | int = "auto", *, levels: tuple[int, ...] = MEGATRON_ZERO) -> list[int]:
    """The slots of ``source`` that ``--remat`` and ``--zero`` allow, at the ZeRO ``levels`` the method has."""
    allowed = allowed_slots(remat, zero)
    return [w for w, (name, _, level) in enumerate(SLOTS) if name == source and allowed[w] and level in levels]


def grid_points(
    setup: CostSetup, *, num_layers: int, degrees: tuple[int, int, int] | None = None
) -> list[tuple[tuple[int, int, int], tuple[int, ...]]]:
    """Every Megatron ``(t, p, d)`` with ``p`` at most the layer count and a submesh of ``t·d`` devices (or
    only ``degrees``), with the logical mesh its stages use: ``(d,)``, ``(t,)`` or ``(d, t)``."""
    cluster, found = setup.cluster, []
    for t in (t for t in range(1, cluster.devices_per_node + 1) if cluster.devices_per_node % t == 0):
        for p in range(1, num_layers + 1):
            if cluster.num_devices % (t * p):
                continue
            d = cluster.num_devices // (t * p)
            if (degrees is not None and (t, p, d) != degrees) or _submesh_of(setup, t * d) is None:
                continue
            found.append(((t, p, d), (d,) if t == 1 else ((t,) if d == 1 else (d, t))))
    return found


def _candidate(
    method: str, degrees: tuple[int, int, int], specs: list[StageSpec], setting: PipelineChoice, setup: CostSetup
) -> Candidate:
    step, memory = approximate(setting, specs)
    fits = memory <= setup.memory_budget_bytes
    return Candidate(
        method=method,
        degrees=degrees,
        step_time_s=step if fits else math.inf,
        memory_bytes=memory,
        specs=tuple(specs),
        setting=setting,
    )


def megatron_grid(
    setting: PipelineChoice,
    setup: CostSetup,
    *,
    remat: str = "auto",
    degrees: tuple[int, int, int] | None = None,
    zero: str | int = "auto",
) -> list[Candidate]:
    """Every grid point (or only ``degrees``, labelled megatron even when it is data parallel), with what Megatron-LM
    has: full or selective recomputation, the distributed optimizer (ZeRO-1); the data-parallel point (1, 1, D)
    also as FSDP (ZeRO-2, ZeRO-3), as PyTorch users run it."""
    num_layers = len(setting.layers.layers)
    found = []
    for (t, p, d), shape in grid_points(setup, num_layers=num_layers, degrees=degrees):
        if setting.rows % d:  # the replicas cannot share the microbatch's rows evenly
            continue
        submesh = _submesh_of(setup, t * d)
        source = Method.DATA_PARALLEL if t == 1 else Method.MEGATRON
        method = Method.DATA_PARALLEL if (t, p) == (1, 1) and degrees is None else Method.MEGATRON
        levels = ZERO_LEVELS if method == Method.DATA_PARALLEL else MEGATRON_ZERO
        for slot, spans in itertools.product(
            _slots(source, remat, zero, levels=levels), equal_spans(setting.layers.kinds, p)
        ):
            specs = [StageSpec(first=a, last=b, submesh=submesh, mesh_shape=shape, slot=slot) for a, b in spans]
            found.append(_candidate(method, (t, p, d), specs, setting, setup))
    return found


def uniform_pipelines(setting: PipelineChoice, setup: CostSetup) -> list[Candidate]:
    cluster, num_layers, arrays = setup.cluster, len(setting.layers.layers), setting.spans.arrays
    found = []
    for p in range(1, min(num_layers, cluster.num_devices) + 1):
        submesh = _submesh_of(setup, cluster.num_devices // p) if cluster.num_devices % p == 0 else None
        if submesh is None or submesh not in setting.spans.meshes:
            continue
        j = setting.spans.index(submesh)
        for spans in equal_spans(setting.layers.kinds, p):
            specs = []
            for s, (a, b) in enumerate(spans):
                in_flight = (
                    setting.num_microbatches
                    if setting.schedule == Schedule.GPIPE
                    else min(p - s, setting.num_microbatches)
                )
                memory = arrays.memory_bytes(in_flight, (a, b, j))
                times = arrays.time_s[a, b, j]
                fitting = np.where(memory <= setup.memory_budget_bytes, times, np.inf)
                # the fastest option that fits; when none does, the smallest (what the does-not-fit figure reports)
                smallest = np.where(np.isfinite(times), memory, np.inf)
                column = int(np.argmin(fitting if np.isfinite(fitting).any() else smallest))
                if column >= len(setting.spans.labels[j]):  # no option at all for these layers
                    break
                shape, slot = setting.spans.labels[j][column]
                specs.append(StageSpec(first=a, last=b, submesh=submesh, mesh_shape=shape, slot=slot))
            if len(specs) == len(spans):
                found.append(_candidate("uniform-pipeline", (0, p, 0), specs, setting, setup))
    return found


def _all_candidates(
    setting: PipelineChoice, setup: CostSetup, *, options: PlanOptions, methods: tuple[str, ...]
) -> list[Candidate]:
    """The candidates of ``methods`` on ``setting`` under the choices ``options`` asks for (recomputation,
    degrees, ZeRO, at most ``max_stages`` stages)."""
    remat, degrees, zero = options.remat, options.degrees, options.zero
    grid = megatron_grid(setting, setup, remat=remat, degrees=degrees, zero=zero) if "megatron" in methods else []
    if "data-parallel" in methods and (degrees is not None or "megatron" not in methods):
        grid += [c for c in megatron_grid(setting, setup, remat=remat, zero=zero) if c.method == Method.DATA_PARALLEL]
    uniform = uniform_pipelines(setting, setup) if "uniform-pipeline" in methods else []
    return [
        candidate
        for candidate in [*grid, *uniform]
        if candidate.method in methods and (options.max_stages is None or len(candidate.specs) <= options.max_stages)
    ]


def _crosses_nodes(candidate: Candidate, setup: CostSetup) -> bool:
    """A Megatron grid point whose data-parallel groups cross nodes (where a lossy gradient sync can pay)."""
    t, _, d = candidate.degrees
    return candidate.method == Method.MEGATRON and d > 1 and t * d > setup.cluster.devices_per_node


def best_handwritten(
    settings: list[PipelineChoice],
    setup: CostSetup,
    *,
    options: PlanOptions,
    keep: int = 3,
    methods: tuple[str, ...] = HANDWRITTEN,
) -> dict[str, list[Candidate]]:
    """Per hand-written method of ``methods``, its ``keep`` fastest fitting candidates over every
    microbatch count, fastest first (the exact price of the first may not fit where the approximation
    did), of at most ``options.max_stages`` stages, under its ``remat`` and ``zero``. With ``options.degrees`` the
    megatron candidates are that one configuration's. With ``options.allow_lossy`` the megatron candidates also hold
    the best of every grid point whose data-parallel groups cross nodes: the approximation charges exact gradient
    sync, which a compressed one can make cheap there."""
    found: dict[str, list[Candidate]] = {}
    wide: dict[tuple[int, int, int], Candidate] = {}
    for setting in settings:
        for candidate in _all_candidates(setting, setup, options=options, methods=methods):
            if not math.isfinite(candidate.step_time_s):
                continue
            found.setdefault(candidate.method, []).append(candidate)
            known = wide.get(candidate.degrees)
            if (
                options.allow_lossy
                and _crosses_nodes(candidate, setup)
                and (known is None or candidate.step_time_s < known.step_time_s)
            ):
                wide[candidate.degrees] = candidate
    best = {method: sorted(items, key=lambda c: c.step_time_s)[:keep] for method, items in found.items()}
    if wide:
        kept = best.setdefault("megatron", [])
        kept += [candidate for candidate in wide.values() if not any(candidate is other for other in kept)]
    return best


def least_memory(
    settings: list[PipelineChoice], setup: CostSetup, *, options: PlanOptions, method: str
) -> Candidate | None:
    """The candidate of ``method`` that needs the least memory per device under the options (for the does-not-fit
    message: what the smallest plan with the choices asked for needs); None if the method has none at all."""
    candidates = [
        candidate
        for setting in settings
        for candidate in _all_candidates(setting, setup, options=options, methods=(method,))
        if math.isfinite(candidate.memory_bytes)
    ]
    return min(candidates, key=lambda candidate: candidate.memory_bytes, default=None)
