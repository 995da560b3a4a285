"""Price a candidate pipeline exactly on whole stages: its step time, memory per device and bubble.

Each stage ``s`` of a candidate is rebuilt as one stage problem and priced by
:func:`planner.inter.stage_pricing.price_stage` (its strategies, time per microbatch without the gradient sync and
optimizer update ``u_s``, and memory with its in-flight microbatches, ``min(S − s, m)`` for 1F1B, ``m`` for GPipe).
Here ``t_s`` adds to it the boundary to the next stage, plus the device's calibrated ``microbatch_overhead_s``
when there are several stages (the pipeline schedule's per-microbatch actions and P2P bookkeeping on the host).
With fewer microbatches than stages 1F1B has no steady state and its timeline is GPipe's, so the plan says
``gpipe`` (what torch's 1F1B schedule requires, and what the executor then runs).

Step time ``T = Σ t_s + (m − 1)·P + U + w + o``, where ``U`` (:func:`_sync_after_s`) is how far the
stages' gradient syncs and optimizer updates ``u_s`` reach past the pipeline phase (each starts after its
own stage's last backward, which ends earlier the later the stage is), and the steady-state period ``P``
(:func:`_period`) is the busiest resource's time per microbatch (a stage's compute without its boundary,
or one direction of a boundary link: a transfer runs on its link while the stages compute the next
microbatch, as in the simulator), unless a stage's round trip through the later stages, shared by the
microbatches it may keep in flight, is longer (``o`` the device's calibrated
``step_overhead_s``; every stage syncs once, after its last backward, in parallel with the others;
``w`` the tied weights' gradient all-reduce over the world,
:func:`planner.costing.estimate.shared_param_sync_s`). The pipeline bubble is
:func:`cost_models.simulator.bubble_fraction` of the pipeline phase ``span = Σ t_s + (m − 1)·P``
(the end-of-step sync and overhead are outside it): ``1 − m·Σ t_s / (S·span)``, as the stage DP's
(:class:`planner.inter.stage_dp.solver.StagePlan`) and the simulator's.
A one-stage plan whose parameters are all replicated runs as DDP (:func:`planner.costing.stage_work.runs_as_ddp`)
and is priced as it runs (:func:`planner.costing.ddp.ddp_step`): no collectives, DDP's buckets
overlapped with the last backward; at a ZeRO level it runs FSDP, priced so too
(:func:`planner.costing.ddp.fsdp_step`, :func:`planner.costing.zero.fsdp_price`).
Each stage's ``u_s`` charges its gradient buckets as they run, overlapped with its last backward, instead of
the stage problem's additive shares, and the candidate runs the fastest gradient sync the options offer
(exact; with ``--allow-lossy`` also compressed or local SGD): :mod:`planner.inter.grad_sync_choice`.
A candidate that no longer fits is dropped (None). The estimate's parts: :mod:`planner.inter.pipeline_estimate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from planner.costing.compression import refusal
from planner.costing.ddp import DdpStep, ddp_step, fsdp_step
from planner.costing.estimate import shared_param_sync_s
from planner.costing.plan_memory import sharded_stage_memory
from planner.costing.setup import CostSetup
from planner.costing.stage_work import runs_as_ddp
from planner.costing.zero import fsdp_memory, runs_as_fsdp
from planner.inter.data_parallel_levels import best_level
from planner.inter.grad_sync_choice import SyncChoice, after_s, choose_grad_sync, offered
from planner.inter.pipeline_estimate import StepTiming, pipeline_estimate
from planner.inter.search import Layering, LayerTables, PipelineChoice, SpanOptions
from planner.inter.stage_dp.boundaries import BoundaryTable
from planner.inter.stage_dp.device_blocks import assign_devices
from planner.inter.stage_dp.solver import StagePlan
from planner.inter.stage_pricing import PricedPipeline, PricedStage, StageSpec, plan_stages, price_stage
from planner.inter.stage_shapes import StageShapes
from planner.ir.graph import OpGraph
from planner.plan import GradSync, Stage
from planner.plan.schedules import Schedule, in_flight_microbatches
from planner.plan.stage import sends_shards


def price_stages(
    setting: PipelineChoice,
    specs: list[StageSpec],
    *,
    full_graph: OpGraph,
    tables: LayerTables,
    refine: bool = True,
    shapes: StageShapes | None = None,
) -> PricedPipeline | None:
    """The exact estimate of a candidate: the stages ``specs`` over the layers of ``setting`` (its graph at the
    microbatch size, microbatch count, schedule and boundary table); None if a stage does not fit (see the module
    docstring). ``refine=False`` prices the composed strategies as they are (a hand-written plan stays itself).
    ``shapes``: stage problems by shape, shared by the candidates of one search (:mod:`planner.inter.stage_shapes`)."""
    setup, graph, layers = tables.setup, setting.graph, setting.layers
    m, schedule = setting.num_microbatches, setting.schedule
    # no steady state: the same timeline as GPipe, which is what runs
    if schedule == Schedule.ONE_F_ONE_B and m < len(specs):
        schedule = Schedule.GPIPE
    line = _price_each(
        graph,
        layers,
        tables,
        specs,
        boundary_s=setting.boundary_s,
        m=m,
        schedule=schedule,
        refine=refine,
        shapes=StageShapes() if shapes is None else shapes,
    )
    if line is None:
        return None
    count, priced, times = len(specs), line.priced, line.times
    total, longest = math.fsum(times), _period(times, line.periods, m=m, schedule=schedule)
    stages = plan_stages(priced, full_graph)
    runs_fsdp = count == 1 and stages[0].is_pure_data_parallel
    if not runs_fsdp and any(stage.zero >= 2 for stage in stages):  # only FSDP runs levels 2 and 3: no candidate
        return None
    if runs_fsdp:  # DDP or FSDP: each ZeRO level priced as it runs
        stages, priced = _at_best_level(stages[0], priced[0], graph, setup, m=m, zero=tables.options.zero)
    tied_s = shared_param_sync_s(stages, graph, setup) if count > 1 else 0.0
    step = _PipelineStep(
        stages=stages,
        priced=priced,
        graph=graph,
        setup=setup,
        m=m,
        schedule=schedule,
        is_ddp=count == 1 and runs_as_ddp(stages),
        fsdp=fsdp_step(stages[0], graph, setup, m=m) if count == 1 and runs_as_fsdp(stages) else None,
        fixed_s=total + (m - 1) * longest + tied_s + setup.cluster.device.step_overhead_s,
        half_overhead_s=(setup.cluster.device.microbatch_overhead_s if count > 1 else 0.0) / 2,
        drains=tuple(line.drains),
    )
    choice = _fastest_sync(step, tables)
    if choice is None:
        return None
    return _pipeline(full_graph, step, choice, times=times, period=longest, tied_s=tied_s)


def _fastest_sync(step: _PipelineStep, tables: LayerTables) -> SyncChoice | None:
    """The fastest gradient sync the options offer that the candidate can run and fits (None: none)."""
    options, setup = tables.options, tables.setup
    return choose_grad_sync(
        offered(allow_lossy=options.allow_lossy, forced=options.grad_sync),
        price=step.under,
        memory_bytes=max(stage.memory_bytes for stage in step.priced),
        budget_bytes=setup.memory_budget_bytes,
    )


@dataclass(frozen=True, kw_only=True)
class _StageLine:
    """A candidate's stages priced one by one, with what the step's closed form reads off them (module docstring)."""

    priced: list[PricedStage]
    times: list[float]  # t_s: the stage, its boundary to the next and the host overhead
    periods: list[float]  # each stage's compute and each boundary link's slower direction
    drains: list[float]  # each stage's backward, half its host overhead and its boundary's gradient direction


def _price_each(
    graph: OpGraph,
    layers: Layering,
    tables: LayerTables,
    specs: list[StageSpec],
    *,
    boundary_s: BoundaryTable,
    m: int,
    schedule: str,
    refine: bool,
    shapes: StageShapes,
) -> _StageLine | None:
    """Each stage priced on its ranks with its in-flight microbatches; None when one does not fit."""
    setup = tables.setup
    cluster = setup.cluster
    ranks = assign_devices(
        [spec.submesh for spec in specs], num_nodes=cluster.num_nodes, devices_per_node=cluster.devices_per_node
    )
    count = len(specs)
    line = _StageLine(priced=[], times=[], periods=[], drains=[])
    for s, spec in enumerate(specs):
        in_flight = in_flight_microbatches(schedule, num_stages=count, stage=s, m=m)
        stage = price_stage(
            graph,
            layers,
            tables,
            spec,
            devices=ranks[s],
            m=m,
            in_flight=in_flight,
            refine=refine,
            exact=count == 1,
            shapes=shapes,
            index=s,
            sends_shards=sends_shards([spec.mesh_shape for spec in specs], s),
        )
        if stage.memory_bytes > setup.memory_budget_bytes:
            return None
        overhead = cluster.device.microbatch_overhead_s if count > 1 else 0.0
        after = link = 0.0
        if s < count - 1:
            after = boundary_s(spec.last, spec.submesh, specs[s + 1].submesh, ranks=ranks[s : s + 2])
            link = boundary_s(
                spec.last, spec.submesh, specs[s + 1].submesh, ranks=ranks[s : s + 2], longest_direction=True
            )
        line.priced.append(stage)
        line.times.append(stage.time_s + after + overhead)
        line.periods.extend((stage.time_s + overhead, link))
        line.drains.append(stage.backward_s + overhead / 2 + (after - link if s < count - 1 else 0.0))
    return line


@dataclass(frozen=True, kw_only=True)
class _PipelineStep:
    """What the step of a priced candidate needs to be priced under each gradient sync (:meth:`under`)."""

    stages: tuple[Stage, ...]
    priced: list[PricedStage]
    graph: OpGraph
    setup: CostSetup
    m: int
    schedule: str
    is_ddp: bool  # one stage run as DDP
    fsdp: DdpStep | None  # one stage run under FSDP, priced as it runs
    fixed_s: float  # Σ t_s + (m − 1)·P + w + o
    half_overhead_s: float  # half the host's per-microbatch overhead (a pipeline's)
    drains: tuple[float, ...]

    def under(self, grad_sync: GradSync) -> tuple[float, float] | None:
        """The step under ``grad_sync`` and the bytes it adds per device (:mod:`planner.inter.grad_sync_choice`)."""
        fsdp, setup = self.fsdp, self.setup
        if refusal(
            grad_sync,
            self.stages,
            zero=fsdp is not None,
            cluster=setup.cluster,
            ddp=self.is_ddp,
            optimizer=setup.optimizer,
        ):
            return None
        if fsdp is not None:
            return fsdp.step_s, 0.0
        if self.is_ddp:
            ddp = ddp_step(self.stages[0], self.graph, setup, m=self.m, grad_sync=grad_sync)
            return ddp.step_s, ddp.state_bytes
        steps, extra = [], 0.0
        for stage in self.priced:
            step_s = stage.step_s
            if stage.backward is not None:  # the buckets instead of the additive shares
                wait, added = after_s(
                    stage.stage,
                    self.graph,
                    stage.backward,
                    setup,
                    grad_sync=grad_sync,
                    last_backward_s=stage.backward_s + self.half_overhead_s,
                    overlapped=self.schedule != Schedule.ZERO_BUBBLE,
                )
                step_s += wait - stage.backward.additive_s
                extra = max(extra, added)
            steps.append(step_s)
        return self.fixed_s + _sync_after_s(steps, list(self.drains)), extra


def _pipeline(
    full_graph: OpGraph, step: _PipelineStep, choice: SyncChoice, *, times: list[float], period: float, tied_s: float
) -> PricedPipeline:
    """The priced candidate under its chosen gradient sync: its estimate, schedule and what the search picked."""
    graph, setup, m, stages = step.graph, step.setup, step.m, step.stages
    ddp = ddp_step(stages[0], graph, setup, m=m, grad_sync=choice.grad_sync) if step.is_ddp else None
    timing = StepTiming(step_s=choice.step_s, times=tuple(times), m=m, period_s=period, tied_s=tied_s)
    estimate = pipeline_estimate(full_graph, setup, step.priced, timing, ddp=ddp if ddp is not None else step.fsdp)
    if choice.grad_sync.lossy:
        estimate = replace(
            estimate,
            memory_per_device_bytes=int(estimate.memory_per_device_bytes + choice.state_bytes),
            savings=replace(estimate.savings, grad_sync_saved_s=choice.saved_s),
        )
    return PricedPipeline(
        stages=stages,
        estimate=estimate,
        num_microbatches=m,
        schedule=Schedule.NONE if len(times) == 1 and m == 1 else step.schedule,
        grad_sync=choice.grad_sync,
        notes=(choice.note(setup),) if choice.grad_sync.lossy else (),
        stage_choices=tuple(stage.picked for stage in step.priced),
    )


def _at_best_level(
    stage: Stage, priced: PricedStage, graph: OpGraph, setup: CostSetup, *, m: int, zero: str | int
) -> tuple[tuple[Stage, ...], list[PricedStage]]:
    """The one-stage data-parallel candidate at its fastest fitting ZeRO level, each priced as DDP or FSDP runs it
    (:mod:`planner.inter.data_parallel_levels`), its stage line that exact comparison."""

    def step_at(level: int) -> float:
        at = replace(stage, zero=level)
        return (ddp_step(at, graph, setup, m=m) if level == 0 else fsdp_step(at, graph, setup, m=m)).step_s

    def memory_at(level: int) -> float:
        at = replace(stage, zero=level)
        if level:
            return fsdp_memory(at, graph, setup, num_microbatches=m).total_bytes
        inputs = frozenset(value.name for value in graph.inputs)
        found = sharded_stage_memory(
            at, graph, setup, in_flight=1, num_microbatches=m, last=True, data_inputs=inputs, ddp=True
        )
        return found.total_bytes

    chosen, line = best_level(stage, graph, setup, zero=zero, step_at=step_at, memory_at=memory_at)
    best = replace(stage, zero=chosen.level, memory_saving=line or stage.memory_saving)
    return (best,), [replace(priced, stage=best, memory_bytes=chosen.memory_bytes)]


def _sync_after_s(steps: list[float], drains: list[float]) -> float:
    """What the step adds after the pipeline phase for the stages' gradient sync and optimizer update ``u_s``
    (``steps``; the gradient sync is what each stage waits for past its last backward,
    :mod:`planner.inter.grad_sync_choice`): stage ``s`` starts its own as soon as its last backward is done,
    which is before the end of the phase by the backward passes still to run in the stages before it
    (``drains[k]``: stage ``k``'s backward, half its host overhead and its boundary's gradient direction), so
    ``max_s (u_s − Σ_{k<s} drains[k])``."""
    before, latest = 0.0, 0.0
    for step_s, drain in zip(steps, drains, strict=True):
        latest = max(latest, step_s - before)
        before += drain
    return latest


def _period(times: list[float], resources: list[float], *, m: int, schedule: str) -> float:
    """The steady-state time per microbatch ``P`` (module docstring): the busiest resource (``resources``: each
    stage's compute and each boundary link's slower direction), or the round trip through the stages after a
    stage shared by the microbatches it may have in flight, whichever is longer (1F1B only: GPipe runs every
    forward before any backward). Stage ``s`` of ``S`` under 1F1B keeps at most ``W_s = min(S − s, m)``
    microbatches in flight, so it waits when its round trip ``t_s + Σ_{k>s} t_k`` (its compute, the boundaries
    both ways and every later stage) exceeds ``W_s·P``: with equal stages and free boundaries this is ``t``, the busiest
    resource."""
    count = len(times)
    period = max(resources)
    # GPipe runs every forward before any backward: no microbatch waits for its own
    if schedule != Schedule.ONE_F_ONE_B:
        return period
    for s in range(count):
        period = max(period, math.fsum(times[s:]) / min(count - s, m))
    return period


def specs_from_dp(plan: StagePlan, spans: SpanOptions, setup: CostSetup) -> list[StageSpec]:
    """StageSpecs of a DP plan whose option labels index ``spans.labels``."""
    specs = []
    for stage in plan.stages:
        j = spans.index(stage.submesh)
        shape, slot = spans.labels[j][stage.option.label]
        specs.append(StageSpec(first=stage.first, last=stage.last, submesh=stage.submesh, mesh_shape=shape, slot=slot))
    return specs
