"""A candidate's stages rebuilt as whole stage problems and priced one by one.

The search composes per-layer options and charges nothing between layers of a stage
(:mod:`planner.inter.layer_costs`). Here each stage ``s`` of a candidate (a :class:`StageSpec`) is rebuilt as one stage
problem (:func:`planner.intra.stage_problem.build_stage_problem` on the stage's subgraph, identical
layers collapsed) and its strategies are read off the layer tables (:func:`_composed_choice`). The
problem is built once per stage shape on canonical ranks and reused wherever the shape recurs, in
this candidate and the others (:mod:`planner.inter.stage_shapes`). Then, per stage (:func:`price_stage`):

* unless it recomputes or shards its state (ZeRO), the exact unconstrained optimum of the whole stage replaces the
  composition when it is faster and still fits with its in-flight microbatches; a plan of one
  stage that does not fit so is re-solved by the memory-constrained ILP, started from the
  composition (:func:`_refined_choice`), so one-stage plans are those of the intra-op ILP;
* its time per microbatch = the stage problem's objective for the choice (inter-layer resharding included)
  without its amortised gradient sync and optimizer update ``u_s`` (:func:`planner.inter.stage_shapes.step_s`), plus its
  recomputed runs' forward once more (:func:`planner.intra.stage_problem.recompute_s`; the slot's ``attention`` or
  ``full`` runs, :mod:`planner.ir.recompute`), plus its ZeRO level's collectives
  (:func:`planner.intra.stage_problem.zero_costs`); the pipeline adds the boundary to the next stage and the
  host overhead (:func:`planner.inter.pricing.price_stages`);
* memory = state + activations × in flight (``min(S − s, m)`` for 1F1B, ``m`` for GPipe;
  with recomputation the activations are what its checkpointed runs keep,
  :func:`planner.intra.stage_problem.kept_bytes`; the state at its ZeRO level; level 3 adds the layer groups
  FSDP holds gathered, :func:`planner.costing.zero.gathered_param_bytes`). Each stage says what its recomputation and
  ZeRO level save against the next-best pair (:meth:`planner.inter.stage_shapes.StageTemplate.memory_saving`,
  ``Stage.memory_saving``);
* its backward's node seconds and additive sync shares (:class:`planner.inter.grad_sync_choice.StageBackward`),
  for the gradient buckets the pipeline's pricing charges instead.

The priced stages become plan stages (:func:`plan_stages`), a parameter read in several stages (tied weights)
placed in the first. What the whole candidate prices to is a :class:`PricedPipeline`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial

from planner.costing.plan_memory import sharded_stage_memory
from planner.costing.setup import CostSetup
from planner.costing.stage_work import explain_stage, runs_as_ddp
from planner.costing.zero import fsdp_memory, gathered_param_bytes, runs_as_fsdp
from planner.inter.grad_sync_choice import StageBackward, stage_backward
from planner.inter.layer_costs import SLOTS
from planner.inter.search import Layering, LayerTables, canonical_mesh
from planner.inter.stage_dp.device_blocks import Submesh
from planner.inter.stage_shapes import StageChoice, StageShapes, StageTemplate, relabel, shape_key
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
    """What a candidate prices to (:func:`planner.inter.pricing.price_stages`)."""

    stages: tuple[Stage, ...]
    estimate: Estimate
    num_microbatches: int
    schedule: str
    notes: tuple[str, ...] = ()  # what a choice beyond the search's saved (schedule variants), for the plan's notes
    grad_sync: GradSync = field(default_factory=GradSync)  # planner.inter.grad_sync_choice
    # per stage, what the search picked on its problem (empty: stages not priced on stage problems)
    stage_choices: tuple[StageChoice, ...] = ()


@dataclass(frozen=True, kw_only=True)
class PricedStage:
    """One stage of a candidate priced (:func:`price_stage`)."""

    stage: Stage  # the plan stage on its ranks, explained
    objective_s: float  # the stage problem's objective for the choice
    time_s: float  # per microbatch, without the gradient sync and optimizer step
    step_s: float  # gradient sync + optimizer update, once per step
    memory_bytes: float
    remat: bool
    picked: StageChoice  # the choice on the stage's problem, carried to the plan
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


def _memory(
    template: StageTemplate,
    choice: tuple[int, ...],
    *,
    remat: str,
    in_flight: int,
    zero: int = 0,
    setup: CostSetup | None = None,
) -> float:
    """Memory bytes per device of a choice with ``in_flight`` microbatches, recomputing the runs of ``remat``
    (their kept bytes), its model state at ZeRO level ``zero``."""
    state = template.costs(choice)[2] if zero == 0 or setup is None else template.zero(choice, zero, setup).state_bytes
    return state + template.recompute_bytes(choice, remat) * in_flight


def _stage_memory(
    template: StageTemplate,
    base: Stage,
    graph: OpGraph,
    setup: CostSetup,
    *,
    choice: tuple[int, ...],
    remat: str,
    zero: int,
    in_flight: int,
    m: int,
    last: bool,
    ddp: bool,
    fsdp: bool,
    pipeline: bool,
    sends_shards: bool = False,
) -> float:
    """The plan stage's memory per device (:func:`planner.costing.plan_memory.sharded_stage_memory`: its state,
    one microbatch's activation timeline, the others in flight; ``last``: it runs the loss), once per choice and
    schedule position; ``ddp``: a one-stage plan run as DDP; ``fsdp``: one run under FSDP
    (:func:`planner.costing.zero.fsdp_memory`); ``pipeline``: a stage of several; ``sends_shards``: it sends to the
    next as shards (:func:`planner.plan.stage.sends_shards`)."""
    key = ("memory", choice, remat, zero, in_flight, m, last, ddp, fsdp, pipeline, sends_shards)
    if fsdp and key not in template.memo:
        template.memo[key] = fsdp_memory(base, template.part, setup, num_microbatches=m).total_bytes
    if key not in template.memo:
        data = frozenset(value.name for value in graph.inputs)
        found = sharded_stage_memory(
            base,
            template.part,
            setup,
            in_flight=in_flight,
            num_microbatches=m,
            last=last,
            data_inputs=data,
            ddp=ddp,
            pipeline=not fsdp and not ddp and pipeline,
            sends_shards=sends_shards,
        )
        template.memo[key] = found.total_bytes
    memory = template.memo[key]
    assert isinstance(memory, float)
    return memory


@dataclass(frozen=True, kw_only=True)
class _Where:
    """Where a stage runs in its candidate, for its memory: its slot, the microbatches, how many it holds at once,
    whether it runs the loss, whether it is the whole plan (one stage), and whether it sends to the next stage
    as shards."""

    slot: int
    m: int
    in_flight: int
    last: bool
    exact: bool
    sends_shards: bool = False


def _explained(stage: Stage, *, graph: OpGraph, setup: CostSetup, zero: str | int) -> tuple:
    """The explanation rows of a plan stage (:func:`planner.costing.stage_work.explain_stage`), as stored."""
    return tuple(explain_stage(stage, graph, setup, zero=zero))


def _priced_memory(
    template: StageTemplate,
    base: Stage,
    planned: Stage,
    graph: OpGraph,
    setup: CostSetup,
    *,
    choice: tuple[int, ...],
    where: _Where,
) -> float:
    """The stage's memory per device (:func:`_stage_memory`), plus at ZeRO-3 in a pipeline the layer groups FSDP
    holds gathered while it computes with them."""
    _, remat, zero = SLOTS[where.slot]
    m, in_flight, last, exact = where.m, where.in_flight, where.last, where.exact
    memory = _stage_memory(
        template,
        base,
        graph,
        setup,
        choice=choice,
        remat=remat,
        zero=zero,
        in_flight=in_flight,
        m=m,
        last=last,
        ddp=exact and runs_as_ddp([base]),
        fsdp=exact and runs_as_fsdp([base]),
        pipeline=not exact,
        sends_shards=where.sends_shards,
    )
    if zero == 3 and not (exact and runs_as_fsdp([base])):  # FSDP holds the groups it computes with unsharded
        memory += gathered_param_bytes(planned, graph, setup)
    return memory


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


def _template(
    part: OpGraph, graph: OpGraph, layers: Layering, tables: LayerTables, spec: StageSpec, m: int
) -> StageTemplate:
    setup, options = tables.setup, tables.options
    mesh = canonical_mesh(setup, spec.submesh, spec.mesh_shape)
    intra = IntraOpOptions(
        num_microbatches=m,
        time_limit_s=options.ilp_time_limit_s,  # ZeRO: the slot's, added
        sequence_parallel=options.space != "alpa",
    )
    problem = build_stage_problem(part, setup, mesh, intra)
    return StageTemplate(
        part=part,
        problem=problem,
        composed=_composed_choice(problem, graph, layers, tables, spec, m),
        layers=tuple(layers.layers[spec.first : spec.last + 1]),
    )


def price_stage(
    graph: OpGraph,
    layers: Layering,
    tables: LayerTables,
    spec: StageSpec,
    *,
    devices: tuple[int, ...],
    m: int,
    in_flight: int,
    refine: bool,
    exact: bool,
    shapes: StageShapes,
    index: int,
    sends_shards: bool = False,
) -> PricedStage:
    """Stage ``index`` of a candidate (``spec``) priced on ranks ``devices`` with ``in_flight`` of ``m``
    microbatches (the module docstring). ``refine``: try the stage's own optimum; ``exact`` (a one-stage plan):
    also the memory-constrained ILP, and a data-parallel slot's memory saving weighs every ZeRO level;
    ``shapes``: the stage problems by shape, shared across candidates; ``sends_shards``: it sends to the next stage
    as shards (:func:`planner.plan.stage.sends_shards`)."""
    setup, options = tables.setup, tables.options
    names = [name for names in layers.layers[spec.first : spec.last + 1] for name in names]
    part = subgraph(graph, names)
    key = (shape_key(part), spec.submesh, spec.mesh_shape, spec.slot, m, options.zero)
    template = shapes.get(key, lambda: _template(part, graph, layers, tables, spec, m))
    _, remat, zero = SLOTS[spec.slot]
    choice = template.composed
    if refine and remat == "none" and zero == 0:
        limit = min(options.ilp_time_limit_s, EXACT_LIMIT_S) if exact else None
        choice = _refined_choice(
            template, choice, in_flight=in_flight, budget=setup.memory_budget_bytes, exact_limit_s=limit
        )
    objective, time_s, step_s = _seconds(template, choice, remat=remat, zero=zero, m=m, setup=setup)
    explain = partial(_explained, graph=graph, setup=setup, zero=options.zero)
    base = template.stage(choice, remat=remat, zero=zero, explain=explain)
    planned = relabel(base, template.part, part, devices=devices, index=index)
    levels = ZERO_LEVELS if exact and SLOTS[spec.slot][0] == "data-parallel" else (0, 1)
    saving = template.memory_saving(
        choice, remat=remat, zero=zero, levels=levels, m=m, in_flight=in_flight, setup=setup
    )
    planned = replace(planned, memory_saving=saving)
    last = bool(set(graph.outputs) & set(names))
    where = _Where(slot=spec.slot, m=m, in_flight=in_flight, last=last, exact=exact, sends_shards=sends_shards)
    memory = _priced_memory(template, base, planned, graph, setup, choice=choice, where=where)
    to_part = dict(zip((n.name for n in template.part.nodes), (n.name for n in part.nodes), strict=True))
    return PricedStage(
        stage=planned,
        objective_s=objective,
        time_s=time_s,
        step_s=step_s,
        memory_bytes=memory,
        remat=bool(remat),
        backward_s=max(0.0, time_s - template.forward_s(choice)),
        backward=_backward(template, base, choice, to_part, setup=setup, zero=options.zero),
        picked=StageChoice(template=template, choice=choice, names={ours: theirs for theirs, ours in to_part.items()}),
    )


def _seconds(
    template: StageTemplate, choice: tuple[int, ...], *, remat: str, zero: int, m: int, setup: CostSetup
) -> tuple[float, float, float]:
    """(objective, time per microbatch, gradient sync and optimizer update per step) of the stage's choice, with its
    recomputation and the collectives of its ZeRO level (:mod:`planner.costing.zero`)."""
    objective, step_s, _, _, _ = template.costs(choice)
    time_s = objective - step_s / m + template.recompute_s(choice, remat)
    if zero:
        costs = template.zero(choice, zero, setup)
        objective += costs.per_microbatch_s + costs.step_s / m
        time_s, step_s = time_s + costs.per_microbatch_s, step_s + costs.step_s
    return objective, time_s, step_s


def _backward(
    template: StageTemplate,
    base: Stage,
    choice: tuple[int, ...],
    to_part: dict[str, str],
    *,
    setup: CostSetup,
    zero: str | int,
) -> StageBackward:
    """The stage's backward node seconds and additive sync shares (once per choice), on the stage's node names."""
    if ("backward", choice) not in template.memo:  # the buckets' ready times, once per choice
        template.memo["backward", choice] = stage_backward(base, template.part, setup, zero=zero)
    known = template.memo["backward", choice]
    assert isinstance(known, StageBackward)
    return StageBackward(node_bwd_s={to_part[n]: t for n, t in known.node_bwd_s.items()}, additive_s=known.additive_s)


def plan_stages(priced: list[PricedStage], full_graph: OpGraph) -> tuple[Stage, ...]:
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
