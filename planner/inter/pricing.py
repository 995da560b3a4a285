"""Turn chosen stages into plan stages, and price them exactly on whole stages.

The search composes per-layer options and charges nothing between layers of a stage
(:mod:`planner.inter.layer_costs`). Here each stage ``s`` of a candidate is rebuilt as one stage
problem (:func:`planner.intra.stage_problem.build_stage_problem` on the stage's subgraph, identical
layers collapsed) and its strategies are read off the layer tables (:func:`_composed_choice`). The
problem is built once per stage shape on canonical ranks and reused wherever the shape recurs, in
this candidate and the others (:mod:`planner.inter.stage_shapes`). Then, per stage:

* unless it recomputes or shards its state (ZeRO), the exact unconstrained optimum of the whole stage replaces the
  composition when it is faster and still fits with its in-flight microbatches; a plan of one
  stage that does not fit so is re-solved by the memory-constrained ILP, started from the
  composition (:func:`_refined_choice`), so one-stage plans are those of the intra-op ILP;
* ``t_s`` = the stage problem's objective for the choice (inter-layer resharding included)
  without its amortised gradient sync and optimizer update ``u_s`` (:func:`planner.inter.stage_shapes.step_s`), plus its
  recomputed runs' forward once more (:func:`planner.intra.stage_problem.recompute_s`; the slot's ``attention`` or
  ``full`` runs, :mod:`planner.ir.recompute`), plus its ZeRO level's collectives
  (:func:`planner.intra.stage_problem.zero_costs`), plus the boundary to the next stage, plus the device's
  calibrated ``microbatch_overhead_s`` when there are several stages (the pipeline schedule's
  per-microbatch actions and P2P bookkeeping on the host);
* memory = state + activations × in flight (``min(S − s, m)`` for 1F1B, ``m`` for GPipe;
  with recomputation the activations are what its checkpointed runs keep, :func:`planner.intra.stage_problem.kept_bytes`;
  the state at its ZeRO level; level 3 adds the layer groups FSDP holds gathered,
  :func:`planner.costing.zero.gathered_param_bytes`). Each stage says what its recomputation and ZeRO level save
  against the next-best pair (:meth:`planner.inter.stage_shapes.StageTemplate.memory_saving`, ``Stage.memory_saving``). With fewer microbatches
  than stages 1F1B has no steady state and its timeline is GPipe's, so the plan says ``gpipe``
  (what torch's 1F1B schedule requires, and what the executor then runs).

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
(:class:`planner.inter.stage_dp.StagePlan`) and the simulator's.
A one-stage plan whose parameters are all replicated runs as DDP (:func:`planner.costing.stage_work.runs_as_ddp`)
and is priced as it runs (:func:`_ddp_step_s`): no collectives, DDP's buckets overlapped with the last backward;
at a ZeRO level it runs FSDP, priced so too (:func:`fsdp_step`, :func:`planner.costing.zero.fsdp_price`).
Each stage's ``u_s`` charges its gradient buckets as they run, overlapped with its last backward, instead of
the stage problem's additive shares, and the candidate runs the fastest gradient sync the options offer
(exact; with ``--allow-lossy`` also compressed or local SGD): :mod:`planner.inter.grad_sync_choice`.
A candidate that no longer fits is dropped (None).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from cost_models.simulator import bubble_fraction
from planner.costing.compression import EXACT, refusal, stage_sync
from planner.costing.estimate import mfu, model_tflops_per_device, shared_param_sync_s
from planner.costing.overlap import after_backward_s
from planner.costing.setup import CostSetup
from planner.costing.stage_work import explain_stage, runs_as_ddp, stage_node_work
from planner.costing.zero import fsdp_price, gathered_param_bytes, runs_as_fsdp
from planner.inter.device_blocks import Submesh, assign_devices
from planner.inter.grad_sync_choice import StageBackward, after_s, choose_grad_sync, offered, stage_backward
from planner.inter.layer_costs import SLOTS
from planner.inter.search import Layering, LayerTables, SpanOptions, boundary_table, canonical_mesh
from planner.inter.stage_dp import StagePlan
from planner.inter.stage_shapes import StageShapes, StageTemplate, relabel, shape_key
from planner.intra.ilp import solve_strategy_ilp
from planner.intra.problem import MemoryBudgetError
from planner.intra.stage_problem import IntraOpOptions, StageProblem, build_stage_problem
from planner.ir.graph import OpGraph, subgraph
from planner.plan import ZERO_LEVELS, Estimate, GradSync, Stage

EXACT_LIMIT_S = 10.0  # the one-stage memory-constrained ILP, at most


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    first: int
    last: int
    submesh: Submesh
    mesh_shape: tuple[int, ...]
    slot: int  # index into layer_costs.SLOTS


@dataclass(frozen=True, kw_only=True)
class PricedPipeline:
    stages: tuple[Stage, ...]
    estimate: Estimate
    num_microbatches: int
    schedule: str
    notes: tuple[str, ...] = ()  # what a choice beyond the search's saved (schedule variants), for the plan's notes
    grad_sync: GradSync = field(default_factory=GradSync)  # planner.inter.grad_sync_choice


@dataclass(frozen=True, kw_only=True)
class _PricedStage:
    stage: Stage  # the plan stage on its ranks, explained
    objective_s: float  # the stage problem's objective for the choice
    time_s: float  # per microbatch, without the gradient sync and optimizer step
    step_s: float  # gradient sync + optimizer update, once per step
    memory_bytes: float
    remat: bool
    backward_s: float = 0.0  # the part of time_s after the forward (recomputation included)
    backward: StageBackward | None = None  # node backward seconds and additive sync shares, for its buckets


def _composed_choice(
    problem: StageProblem, graph: OpGraph, layers: Layering, tables: LayerTables, spec: StageSpec, m: int
) -> tuple[int, ...]:
    owner = {
        name: (index, position) for index, names in enumerate(layers.layers) for position, name in enumerate(names)
    }
    choice = []
    for v, name in enumerate(problem.variables):
        layer, position = owner[name]
        kind = layers.kinds[layer]
        table = tables.get(graph, layers, kind, spec.submesh, spec.mesh_shape, m)
        option = table.options[spec.slot]
        assert option is not None, f"slot {SLOTS[spec.slot]} has no option"
        kind_name = layers.layers[kind][position]
        wanted = table.strategy_name(kind_name, option)
        names = [strategy.name for strategy in problem.strategies[v]]
        choice.append(names.index(wanted) if wanted in names else table.variable_choice(kind_name, option))
    return tuple(choice)


def _memory(template: StageTemplate, choice: tuple[int, ...], *, remat: str, in_flight: int, zero: int = 0,
            setup: CostSetup | None = None) -> float:  # fmt: skip
    """Memory bytes per device of a choice with ``in_flight`` microbatches, recomputing the runs of ``remat``
    (their kept bytes), its model state at ZeRO level ``zero``."""
    state = template.costs(choice)[2] if zero == 0 or setup is None else template.zero(choice, zero, setup).state_bytes
    return state + template.recompute_bytes(choice, remat) * in_flight


def _refined_choice(
    template: StageTemplate, choice: tuple[int, ...], *, in_flight: int, budget: float, exact_limit_s: float | None
) -> tuple[int, ...]:
    """The stage's unconstrained optimum if it fits; else, with ``exact_limit_s``, the memory-constrained
    ILP (memory row: state + activations × in flight) started from ``choice``; else ``choice``."""
    better = template.unconstrained()
    if _memory(template, better, remat="none", in_flight=in_flight) <= budget:
        return better if template.costs(better)[0] < template.costs(choice)[0] else choice
    if exact_limit_s is None:
        return choice
    problem = template.problem
    memory = tuple(tuple(c.state_bytes + c.activation_bytes * in_flight for c in row) for row in problem.costs)
    constrained = replace(problem.problem, node_memory=memory, memory_budget=budget)
    try:
        return solve_strategy_ilp(constrained, time_limit_s=exact_limit_s, incumbents=[choice]).choice
    except MemoryBudgetError:
        return choice


def _template(part: OpGraph, graph: OpGraph, layers: Layering, tables: LayerTables, spec: StageSpec, m: int
              ) -> StageTemplate:  # fmt: skip
    setup, options = tables.setup, tables.options
    mesh = canonical_mesh(setup, spec.submesh, spec.mesh_shape)
    intra = IntraOpOptions(num_microbatches=m, time_limit_s=options.ilp_time_limit_s)  # ZeRO: the slot's, added
    problem = build_stage_problem(part, setup, mesh, intra)
    return StageTemplate(part=part, problem=problem, composed=_composed_choice(problem, graph, layers, tables, spec, m),
                         layers=tuple(layers.layers[spec.first : spec.last + 1]))  # fmt: skip


def _price_stage(
    graph: OpGraph, layers: Layering, tables: LayerTables, spec: StageSpec, *, devices: tuple[int, ...], m: int,
    in_flight: int, refine: bool, exact: bool, shapes: StageShapes, index: int,
) -> _PricedStage:  # fmt: skip
    setup, options = tables.setup, tables.options
    names = [name for names in layers.layers[spec.first : spec.last + 1] for name in names]
    part = subgraph(graph, names)
    key = (shape_key(part), spec.submesh, spec.mesh_shape, spec.slot, m, options.zero)
    template = shapes.get(key, lambda: _template(part, graph, layers, tables, spec, m))
    _, remat, zero = SLOTS[spec.slot]
    choice = template.composed
    if refine and remat == "none" and zero == 0:
        limit = min(options.ilp_time_limit_s, EXACT_LIMIT_S) if exact else None
        choice = _refined_choice(template, choice, in_flight=in_flight, budget=setup.memory_budget_bytes,
                                 exact_limit_s=limit)  # fmt: skip
    objective, step_s, _, _, _ = template.costs(choice)
    memory = _memory(template, choice, remat=remat, in_flight=in_flight, zero=zero, setup=setup)
    time_s = objective - step_s / m + template.recompute_s(choice, remat)
    if zero:  # the slot's ZeRO level (planner.costing.zero)
        costs = template.zero(choice, zero, setup)
        objective += costs.per_microbatch_s + costs.step_s / m
        time_s, step_s = time_s + costs.per_microbatch_s, step_s + costs.step_s

    def explain(stage: Stage) -> tuple:
        return tuple(row.to_json() for row in explain_stage(stage, graph, setup, zero=options.zero))

    base = template.stage(choice, remat=remat, zero=zero, explain=explain)
    planned = relabel(base, template.part, part, devices=devices, index=index)
    levels = ZERO_LEVELS if exact and SLOTS[spec.slot][0] == "data-parallel" else (0, 1)
    saving = template.memory_saving(choice, remat=remat, zero=zero, levels=levels, m=m, in_flight=in_flight,
                                    setup=setup)  # fmt: skip
    planned = replace(planned, memory_saving=saving)
    if zero == 3:  # FSDP holds the groups it computes with and prefetches unsharded
        memory += gathered_param_bytes(planned, graph, setup)
    if ("backward", choice) not in template.memo:  # the buckets' ready times, once per choice
        template.memo["backward", choice] = stage_backward(base, template.part, setup, zero=options.zero)
    known = template.memo["backward", choice]
    assert isinstance(known, StageBackward)
    names = dict(zip((n.name for n in template.part.nodes), (n.name for n in part.nodes), strict=True))
    backward = StageBackward(node_bwd_s={names[n]: t for n, t in known.node_bwd_s.items()}, additive_s=known.additive_s)
    return _PricedStage(stage=planned, objective_s=objective, time_s=time_s, step_s=step_s, memory_bytes=memory,
                        remat=bool(remat), backward_s=max(0.0, time_s - template.forward_s(choice)),
                        backward=backward)  # fmt: skip


def price_stages(
    *, full_graph: OpGraph, graph: OpGraph, layers: Layering, tables: LayerTables, specs: list[StageSpec], m: int,
    schedule: str, refine: bool = True, shapes: StageShapes | None = None,
) -> PricedPipeline | None:  # fmt: skip
    """The exact estimate of a candidate (see the module docstring); None if a stage does not fit.

    ``refine=False`` prices the composed strategies as they are (a hand-written plan stays itself).
    ``shapes``: stage problems by shape, shared by the candidates of one search (:mod:`planner.inter.stage_shapes`)."""
    setup = tables.setup
    cluster = setup.cluster
    ranks = assign_devices([spec.submesh for spec in specs], num_nodes=cluster.num_nodes,
                           devices_per_node=cluster.devices_per_node)  # fmt: skip
    boundary = boundary_table(graph, layers, setup)
    shapes = StageShapes() if shapes is None else shapes
    count, priced, times, periods, drains = len(specs), [], [], [], []
    if schedule == "1f1b" and m < count:  # no steady state: the same timeline as GPipe, which is what runs
        schedule = "gpipe"
    for s, spec in enumerate(specs):
        in_flight = m if schedule == "gpipe" else min(count - s, m)
        stage = _price_stage(graph, layers, tables, spec, devices=ranks[s], m=m, in_flight=in_flight,
                             refine=refine, exact=count == 1, shapes=shapes, index=s)  # fmt: skip
        if stage.memory_bytes > setup.memory_budget_bytes:
            return None
        overhead = cluster.device.microbatch_overhead_s if count > 1 else 0.0
        after = link = 0.0
        if s < count - 1:
            after = boundary(spec.last, spec.submesh, specs[s + 1].submesh, ranks=ranks[s : s + 2])
            link = boundary(spec.last, spec.submesh, specs[s + 1].submesh, ranks=ranks[s : s + 2],
                            longest_direction=True)  # fmt: skip
        priced.append(stage)
        times.append(stage.time_s + after + overhead)
        periods.extend((stage.time_s + overhead, link))
        drains.append(stage.backward_s + overhead / 2 + (after - link if s < count - 1 else 0.0))
    total, longest = math.fsum(times), _period(times, periods, m=m, schedule=schedule)
    stages = _plan_stages(priced, full_graph)
    tied_s = shared_param_sync_s(stages, graph, setup) if count > 1 else 0.0
    options = tables.options
    is_ddp = count == 1 and runs_as_ddp(stages)
    fsdp = fsdp_step(stages[0], graph, setup, m=m) if count == 1 and runs_as_fsdp(stages) else None
    fixed = total + (m - 1) * longest + tied_s + cluster.device.step_overhead_s
    half = (cluster.device.microbatch_overhead_s if count > 1 else 0.0) / 2

    def price(grad_sync: GradSync) -> tuple[float, float] | None:
        """The step under ``grad_sync`` and the bytes it adds per device (:mod:`planner.inter.grad_sync_choice`)."""
        if refusal(grad_sync, stages, zero=fsdp is not None, cluster=cluster, ddp=is_ddp):
            return None
        if fsdp is not None:
            return fsdp.step_s, 0.0
        if is_ddp:
            ddp = _ddp_step_s(stages[0], graph, setup, m=m, grad_sync=grad_sync)
            return ddp.step_s, ddp.state_bytes
        steps, extra = [], 0.0
        for stage in priced:
            step_s = stage.step_s
            if stage.backward is not None:  # the buckets instead of the additive shares
                wait, added = after_s(stage.stage, graph, stage.backward, setup, grad_sync=grad_sync,
                                      last_backward_s=stage.backward_s + half,
                                      overlapped=schedule != "zero-bubble")  # fmt: skip
                step_s += wait - stage.backward.additive_s
                extra = max(extra, added)
            steps.append(step_s)
        return fixed + _sync_after_s(steps, drains), extra

    choice = choose_grad_sync(offered(allow_lossy=options.allow_lossy, forced=options.grad_sync), price=price,
                              memory_bytes=max(stage.memory_bytes for stage in priced),
                              budget_bytes=setup.memory_budget_bytes)  # fmt: skip
    if choice is None:
        return None
    ddp = _ddp_step_s(stages[0], graph, setup, m=m, grad_sync=choice.grad_sync) if is_ddp else None
    estimate = _estimate(full_graph, setup, priced, stages, times, step=choice.step_s, m=m, tied_s=tied_s,
                         period=longest, ddp=ddp if ddp is not None else fsdp)  # fmt: skip
    if choice.grad_sync.lossy:
        estimate = replace(estimate, memory_per_device_bytes=int(estimate.memory_per_device_bytes + choice.state_bytes),
                           breakdown_s={**estimate.breakdown_s, "grad_sync_saved_s": choice.saved_s})  # fmt: skip
    return PricedPipeline(
        stages=stages,
        estimate=estimate,
        num_microbatches=m,
        schedule="none" if count == 1 and m == 1 else schedule,
        grad_sync=choice.grad_sync,
        notes=(choice.note(),) if choice.grad_sync.lossy else (),
    )


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
    forward before any backward). Stage ``s`` of ``S`` under 1F1B keeps at most ``W_s = min(S − s, m)`` microbatches in flight, so it waits when its round trip
    ``t_s + Σ_{k>s} t_k`` (its compute, the boundaries both ways and every later stage) exceeds ``W_s·P``:
    with equal stages and free boundaries this is ``t``, the busiest resource."""
    count = len(times)
    period = max(resources)
    if schedule != "1f1b":  # GPipe runs every forward before any backward: no microbatch waits for its own
        return period
    for s in range(count):
        period = max(period, math.fsum(times[s:]) / min(count - s, m))
    return period


def fsdp_step(stage: Stage, graph: OpGraph, setup: CostSetup, *, m: int) -> DdpStep:
    """A data-parallel plan the executor runs under FSDP (ZeRO level ≥ 1), priced as it runs: each node's work on
    plain tensors, the gathers each microbatch waits for and the reduce-scatters the step waits for past its last
    backward (:func:`planner.costing.zero.fsdp_price`), the optimizer on the shards and the copies."""
    work = stage_node_work(stage, graph, setup, ddp=True)
    price = fsdp_price(stage, graph, setup, work=work, num_microbatches=m)
    compute = math.fsum(w.fwd_s + w.bwd_s + w.recompute_s for w in work.values())
    waits = m * (price.forward_wait_s + price.backward_wait_s) + price.tail_s
    step = math.fsum(w.step_s - w.zero_step_s for w in work.values())
    return DdpStep(step_s=m * compute + waits + step + setup.cluster.device.step_overhead_s, exposed_sync_s=waits,
                   whole_sync_s=price.comm_s)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class DdpStep:
    step_s: float
    exposed_sync_s: float  # DDP's bucketed all-reduce the backward pass does not hide (local SGD's average too)
    whole_sync_s: float  # all of it
    state_bytes: float = 0.0  # what the gradient sync adds per device (PowerSGD's error feedback)


def _ddp_step_s(stage: Stage, graph: OpGraph, setup: CostSetup, *, m: int, grad_sync: GradSync = EXACT) -> DdpStep:
    """A one-stage plan the executor runs as DDP, priced as it runs: each node's work on plain tensors
    (no collectives), the step's optimizer and bucket copies, and DDP's buckets overlapped with the last
    backward (recomputation first) instead of the parameters' additive shares (:mod:`planner.costing.overlap`),
    priced under ``grad_sync`` (:mod:`planner.costing.compression`)."""
    work = stage_node_work(stage, graph, setup, ddp=True)
    forward = math.fsum(w.fwd_s for w in work.values())
    backward = math.fsum(w.bwd_s + w.recompute_s for w in work.values())  # the recomputed forward first
    sync = stage_sync(stage, graph, {name: w.bwd_s for name, w in work.items()}, setup, grad_sync=grad_sync, ddp=True)
    waited = after_backward_s(sync.segments, backward_s=backward) + sync.amortised_s
    step = math.fsum(w.step_s - w.grad_sync_s for w in work.values())
    return DdpStep(step_s=m * (forward + backward) + step + waited + setup.cluster.device.step_overhead_s,
                   exposed_sync_s=waited, whole_sync_s=sync.comm_s, state_bytes=sync.state_bytes)  # fmt: skip


def reprice_data_parallel(candidate: PricedPipeline, graph: OpGraph, setup: CostSetup, *, allow_lossy: bool,
                          forced: GradSync | None, zero: bool) -> PricedPipeline | None:  # fmt: skip
    """The pure data-parallel plan (one stage, one microbatch, ``graph`` the whole batch's) under the gradient
    syncs offered (:func:`planner.inter.grad_sync_choice.offered`), each lossy one's saving over exact sync
    priced as DDP runs it (:func:`_ddp_step_s`); None when none can run."""
    choices = offered(allow_lossy=allow_lossy, forced=forced)
    ddp = runs_as_ddp(candidate.stages, zero=zero)
    exact = _ddp_step_s(candidate.stages[0], graph, setup, m=1) if ddp and any(g.lossy for g in choices) else None

    def price(grad_sync: GradSync) -> tuple[float, float] | None:
        if not grad_sync.lossy:
            return candidate.estimate.step_time_s, 0.0
        if exact is None or refusal(grad_sync, candidate.stages, zero=zero, cluster=setup.cluster, ddp=ddp):
            return None
        variant = _ddp_step_s(candidate.stages[0], graph, setup, m=1, grad_sync=grad_sync)
        return candidate.estimate.step_time_s - exact.step_s + variant.step_s, variant.state_bytes

    choice = choose_grad_sync(choices, price=price, memory_bytes=candidate.estimate.memory_per_device_bytes,
                              budget_bytes=setup.memory_budget_bytes)  # fmt: skip
    if choice is None or not choice.grad_sync.lossy:
        return None if choice is None else candidate
    devices = setup.cluster.num_devices
    estimate = replace(candidate.estimate, step_time_s=choice.step_s,
                       memory_per_device_bytes=int(candidate.estimate.memory_per_device_bytes + choice.state_bytes),
                       tflops_per_device=model_tflops_per_device(graph, step_time_s=choice.step_s, num_devices=devices),
                       mfu=mfu(graph, setup, step_time_s=choice.step_s, num_devices=devices),
                       breakdown_s={**candidate.estimate.breakdown_s, "grad_sync_saved_s": choice.saved_s})  # fmt: skip
    return replace(candidate, estimate=estimate, grad_sync=choice.grad_sync, notes=(*candidate.notes, choice.note()))


def _plan_stages(priced: list[_PricedStage], full_graph: OpGraph) -> tuple[Stage, ...]:
    """Plan stages; a parameter read in several stages (tied weights) is placed in the first."""
    stages, placed = [], set()
    for stage in priced:
        base = stage.stage
        placements = {name: spec for name, spec in base.param_placements.items() if name not in placed}
        placed.update(placements)
        stages.append(replace(base, param_placements=placements))
    missing = [name for name in full_graph.param_names if name not in placed]
    if missing:  # parameters no node reads: replicated on the first stage
        first = stages[0]
        extra = {name: ("R",) * len(first.mesh_shape) for name in missing}
        stages[0] = replace(first, param_placements={**first.param_placements, **extra})
    return tuple(stages)


def _estimate(graph: OpGraph, setup: CostSetup, priced: list[_PricedStage], stages: tuple[Stage, ...],
              times: list[float], *, step: float, m: int, period: float, tied_s: float = 0.0,
              ddp: DdpStep | None = None) -> Estimate:  # fmt: skip
    num_devices, count = setup.cluster.num_devices, len(times)
    longest = period
    if count == 1 and m == 1:
        rows = stages[0].explanation
        breakdown = {
            "compute_s": sum(r["compute_s"] for r in rows), "comm_s": sum(r["comm_s"] for r in rows),
            "grad_sync_and_optimizer_s": sum(r["step_s"] for r in rows),
            "reshard_s": sum(r["reshard_s"] for r in rows),
            "recompute_s": times[0] + priced[0].step_s - priced[0].objective_s,
        }  # fmt: skip
        if ddp is not None:  # the plan runs as DDP: its sync is DDP's buckets, mostly behind the backward
            compute, recompute = breakdown["compute_s"], breakdown["recompute_s"]
            rest = step - ddp.exposed_sync_s - compute - recompute - setup.cluster.device.step_overhead_s
            breakdown = {"compute_s": compute, "recompute_s": recompute, "grad_sync_s": ddp.exposed_sync_s,
                         "grad_sync_overlapped_s": ddp.whole_sync_s - ddp.exposed_sync_s,
                         "optimizer_and_bucket_copies_s": rest}  # fmt: skip
    else:
        sync = max(stage.step_s for stage in priced)
        breakdown = {"steady_s": m * longest, "fill_and_drain_s": math.fsum(times) - longest,
                     "grad_sync_and_optimizer_s": sync}  # fmt: skip
        if tied_s:
            breakdown["tied_grad_sync_s"] = tied_s
    return Estimate(
        step_time_s=step,
        per_stage_time_s=tuple(times),
        memory_per_device_bytes=int(max(stage.memory_bytes for stage in priced)),
        bubble_fraction=bubble_fraction([m * t for t in times], pipeline_span_s=math.fsum(times) + (m - 1) * longest),
        tflops_per_device=model_tflops_per_device(graph, step_time_s=step, num_devices=num_devices),
        mfu=mfu(graph, setup, step_time_s=step, num_devices=num_devices),
        breakdown_s=breakdown,
    )


def specs_from_dp(plan: StagePlan, spans: SpanOptions, setup: CostSetup) -> list[StageSpec]:
    """StageSpecs of a DP plan whose option labels index ``spans.labels``."""
    specs = []
    for stage in plan.stages:
        j = spans.index(stage.submesh)
        shape, slot = spans.labels[j][stage.option.label]
        specs.append(StageSpec(first=stage.first, last=stage.last, submesh=stage.submesh, mesh_shape=shape, slot=slot))
    return specs
