"""Cost options of one layer on one logical mesh, for composing pipeline stages (Alpa §5).

A layer (:func:`planner.ir.layers.graph_layers`) is cut out of the graph as its own
:class:`~planner.ir.graph.OpGraph` (:func:`subgraph`): values from other layers become graph
inputs, so the stage problem (:func:`planner.intra.stage_problem.build_stage_problem`) prices its
operators alone. :func:`layer_table` builds that problem once and reads off a fixed list of
*slots*, each an assignment of strategies:

* ``λ = κ·t₀/M₀`` for κ in :data:`LAMBDA_STEPS`: the exact minimum of ``time + λ·memory``
  (:func:`planner.intra.ilp.solve_unconstrained`, variable elimination) — a Lagrangian sweep of the
  memory row that gives supported (time, memory) Pareto points; ``t₀, M₀`` are the time and
  memory of the ``λ = 0`` optimum;
* the data-parallel and Megatron assignments (:mod:`planner.intra.incumbents`), so no hand-written
  layout is outside the search;

and each with every recomputation and ZeRO level (:func:`_option`), one *slot* per
(source, recomputation, ZeRO level) of :data:`SLOTS`:

* no recomputation: time = the problem's objective; activations kept = saved outputs' bytes;
* ``attention`` (selective: the attention cores, :func:`planner.ir.recompute.attention_cores`; no slot for
  a layer without one) or ``full`` (the whole layer): time + the recomputed nodes' forward once more
  (:func:`planner.intra.stage_problem.recompute_s`: forward compute, half the collectives and half the
  resharding into them, the price the simulator charges too); activations kept = what the runs keep
  (:func:`planner.intra.stage_problem.kept_bytes`: the layer's inputs under ``full``);
* what the layer's tape holds beyond those figures (:func:`planner.costing.plan_memory.layer_memory`, as the exact
  pricing charges a whole stage): the resharded copies of inputs its operators save, added to its activations; the
  peak of one microbatch in it beyond what it keeps (``peak_extra_bytes``); the gradient buckets' copy of its
  synced gradients on a mesh of several devices (``sync_bytes``, none under FSDP);
* a layer that computes model outputs also holds them and the loss's tensors once per stage
  (:func:`loss_and_output_bytes`, added to its state by :func:`with_loss`);
* ZeRO level ``z`` over the data-parallel axes (:mod:`planner.costing.zero`): state bytes and time of the
  parameter nodes priced again at ``z`` (:func:`planner.intra.stage_problem.zero_costs`). Levels 2 and 3 run
  under FSDP, on a data-parallel plan only: they are slots of the ``data-parallel`` source alone, and the
  stage DP offers them only for one stage of every layer on every device (:mod:`planner.inter.search`).

A stage of several layers takes the same slot in each (:mod:`planner.inter.search`), so its time
and memory are sums over its layers. Values crossing between layers are charged no
resharding here; the chosen plan is re-priced on whole stages afterwards
(:mod:`planner.inter.pricing`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from planner.costing.plan_memory import LayerMemory, layer_memory
from planner.costing.setup import CostSetup
from planner.intra.ilp import solve_unconstrained
from planner.intra.incumbents import data_parallel_choice, megatron_choice
from planner.intra.problem import evaluate
from planner.intra.stage_problem import (
    IntraOpOptions,
    StageProblem,
    build_stage_problem,
    kept_bytes,
    recompute_s,
    zero_costs,
)
from planner.ir.graph import OpGraph
from planner.ir.recompute import REMAT_KINDS, remat_runs
from planner.plan import ZERO_LEVELS
from planner.sharding.specs import StageMesh

LAMBDA_STEPS = (0.0, 0.25, 1.0, 4.0)
SOURCES = (*(f"λ={kappa:g}" for kappa in LAMBDA_STEPS), "data-parallel", "megatron")
FSDP_LEVELS = (2, 3)  # ZeRO levels that run under FSDP only: data-parallel plans
# (source, recomputation, ZeRO level); levels 2 and 3 for the data-parallel layout only
SLOTS = tuple(
    (source, remat, zero)
    for zero in ZERO_LEVELS
    for remat in REMAT_KINDS
    for source in SOURCES
    if zero not in FSDP_LEVELS or source == "data-parallel"
)


ROWS = ("time_s", "state_bytes", "activation_bytes", "peak_extra_bytes", "sync_bytes")  # LayerTable.arrays


@dataclass(frozen=True, kw_only=True)
class LayerOption:
    time_s: float  # forward + backward of one microbatch, gradient sync amortised
    state_bytes: float
    activation_bytes: float  # kept per in-flight microbatch
    remat: str  # REMAT_KINDS
    choice: tuple[int, ...]  # strategy per variable of the table's problem
    source: str
    zero: int = 0
    peak_extra_bytes: float = 0.0  # one microbatch's peak in the layer beyond what it keeps
    sync_bytes: float = 0.0  # the gradient buckets' copy of its synced gradients


@dataclass(frozen=True, kw_only=True)
class LayerTable:
    """One layer's option per slot on one mesh (None where the slot has none), and how to read a choice
    back by name: the problem's variables, their representatives and strategy names (the problem itself
    is dropped, so a table is small enough to come back from a worker process)."""

    variables: tuple[str, ...]
    representative: dict[str, str]
    strategy_names: tuple[tuple[str, ...], ...]  # per variable
    options: tuple[LayerOption | None, ...]  # aligned with SLOTS

    def strategy_name(self, node: str, option: LayerOption) -> str:
        """The strategy ``option`` gives ``node`` (a node of this table's layer)."""
        variable = self.variables.index(self.representative[node])
        return self.strategy_names[variable][option.choice[variable]]

    def variable_choice(self, node: str, option: LayerOption) -> int:
        return option.choice[self.variables.index(self.representative[node])]

    def arrays(self) -> np.ndarray:
        """(5, slots): time, state, activation, peak-extra and sync bytes (rows of :data:`ROWS`); inf time for an
        empty slot."""
        out = np.zeros((len(ROWS), len(SLOTS)))
        for w, option in enumerate(self.options):
            out[:, w] = (np.inf, 0, 0, 0, 0) if option is None else tuple(getattr(option, row) for row in ROWS)
        return out


def split_costs(problem: StageProblem, choice: tuple[int, ...]) -> tuple[float, float, float]:
    """(state bytes, activation bytes, compute seconds) of an assignment, over every node of the graph."""
    state = activation = compute = 0.0
    for node in problem.graph.nodes:
        variable = problem.variables.index(problem.representative[node.name])
        cost = problem.costs[variable][choice[variable]]
        state, activation, compute = (
            state + cost.state_bytes,
            activation + cost.activation_bytes,
            compute + cost.compute_s,
        )
    return state, activation, compute


@dataclass(frozen=True, kw_only=True)
class _Base:
    """A choice's time and bytes without recomputation, at the problem's ZeRO level."""

    time_s: float
    state_bytes: float
    activation_bytes: float


def _option(
    problem: StageProblem,
    choice: tuple[int, ...],
    base: _Base,
    *,
    source: str,
    remat: str,
    runs: tuple[tuple[str, ...], ...],
    zero: int,
    setup: CostSetup,
    memo: dict,
) -> LayerOption | None:
    """The slot's option (a layer without attention cores recomputes nothing under ``attention``); ``memo`` holds
    each choice's recomputation and ZeRO figures once (sources often share a choice)."""
    time_s, state, activation = base.time_s, base.state_bytes, base.activation_bytes
    if runs:
        if (choice, remat) not in memo:
            memo[choice, remat] = (recompute_s(problem, choice, runs), kept_bytes(problem, choice, runs))
        added, activation = memo[choice, remat]
        time_s += added
    if (choice, remat, "tape") not in memo:
        nodes = problem.graph.nodes
        chosen = {node.name: problem.strategy_of(node.name, choice) for node in nodes}
        costs = {node.name: problem.cost_of(node.name, choice) for node in nodes}
        memo[choice, remat, "tape"] = layer_memory(problem.graph, chosen, setup, problem.mesh, runs=runs, costs=costs)
    tape = memo[choice, remat, "tape"]
    assert isinstance(tape, LayerMemory)
    if zero:
        if (choice, zero) not in memo:
            memo[choice, zero] = zero_costs(problem, choice, level=zero, setup=setup)
        costs = memo[choice, zero]
        time_s += costs.per_microbatch_s + costs.step_s / problem.num_microbatches
        state = costs.state_bytes
    return LayerOption(
        time_s=time_s,
        state_bytes=state,
        activation_bytes=activation + tape.copies_bytes,
        remat=remat,
        choice=choice,
        source=source,
        zero=zero,
        peak_extra_bytes=tape.peak_extra_bytes,
        sync_bytes=0.0 if zero in FSDP_LEVELS else tape.sync_bytes,
    )


def _lagrangian_choices(problem: StageProblem, options: IntraOpOptions) -> list[tuple[int, ...]]:
    """The exact minimiser of time + λ·memory for each λ of :data:`LAMBDA_STEPS`."""
    base = problem.problem
    first = solve_unconstrained(base, time_limit_s=options.time_limit_s).choice
    time_s, memory = evaluate(base, first)
    choices = [first]
    for kappa in LAMBDA_STEPS[1:]:
        if memory <= 0 or time_s <= 0:
            choices.append(first)
            continue
        scale = kappa * time_s / memory
        costs = tuple(
            tuple(c + scale * m for c, m in zip(cs, ms, strict=True))
            for cs, ms in zip(base.node_costs, base.node_memory, strict=True)
        )
        weighted = replace(base, node_costs=costs, memory_budget=None)
        choices.append(solve_unconstrained(weighted, time_limit_s=options.time_limit_s).choice)
    return choices


def layer_table(
    layer: OpGraph,
    setup: CostSetup,
    mesh: StageMesh,
    *,
    options: IntraOpOptions,
    sources: tuple[str, ...] | None = None,
) -> LayerTable:
    """The options of ``layer`` on ``mesh`` at its microbatch size, one per slot of :data:`SLOTS`; only the
    slots of ``sources`` when given (the others None)."""
    problem = build_stage_problem(layer, setup, mesh, options)
    wanted = SOURCES if sources is None else sources
    choices: dict[str, tuple[int, ...] | None] = {}
    if any(source.startswith("λ=") for source in wanted):
        choices.update(zip(SOURCES[: len(LAMBDA_STEPS)], _lagrangian_choices(problem, options), strict=True))
    if "data-parallel" in wanted:
        choices["data-parallel"] = data_parallel_choice(problem)
    if "megatron" in wanted:
        choices["megatron"] = megatron_choice(problem)
    nodes = [node.name for node in layer.nodes]
    runs = {kind: remat_runs(kind, layer, nodes) for kind in REMAT_KINDS}
    bases: dict[tuple[int, ...], _Base] = {}
    memo: dict[tuple, object] = {}
    found: list[LayerOption | None] = []
    for source, remat, zero in SLOTS:
        choice = choices.get(source) if source in wanted else None
        if choice is not None and choice not in bases:
            time_s, _ = evaluate(problem.problem, choice)
            state, activation, _ = split_costs(problem, choice)
            bases[choice] = _Base(time_s=time_s, state_bytes=state, activation_bytes=activation)
        found.append(
            None
            if choice is None
            else _option(
                problem,
                choice,
                bases[choice],
                source=source,
                remat=remat,
                runs=runs[remat],
                zero=zero,
                setup=setup,
                memo=memo,
            )
        )
    names = tuple(tuple(strategy.name for strategy in row) for row in problem.strategies)
    return LayerTable(
        variables=tuple(problem.variables),
        representative=dict(problem.representative),
        strategy_names=names,
        options=tuple(found),
    )


def loss_and_output_bytes(
    graph: OpGraph,
    names: tuple[str, ...] | list[str],
    setup: CostSetup,
    *,
    num_devices: int = 1,
    mesh_shape: tuple[int, ...] | None = None,
    num_microbatches: int = 1,
) -> float:
    """What the layer of ``names`` adds once per stage when it computes model outputs: the outputs, held whole by
    the runner until their backward ends, and the loss's tensors on them
    (:func:`planner.costing.stage_memory.loss_bytes`; the estimate charges them on the activations' timeline,
    :mod:`planner.costing.plan_memory`); 0 for any other layer. Where the model's outputs are batch-major, a stage
    on ``mesh_shape`` keeps its ``1/n`` of the rows of them instead (:func:`planner.plan.stage.loss_row_axes`,
    :meth:`~planner.costing.setup.CostSetup.loss_rows`); under a runtime that keeps each rank's share
    (``RuntimeProfile.local_outputs``: Megatron-LM's logits split over its replicas' rows and the vocabulary)
    both are ``1/num_devices`` of that, ``num_devices`` the stage mesh's."""
    mine = set(names)
    metas = [graph.node(name).output for name in dict.fromkeys(graph.outputs) if name in mine]
    floating = [meta for meta in metas if meta.is_floating]
    itemsize = setup.activation_itemsize
    held = sum(meta.numel * itemsize if itemsize else meta.nbytes for meta in floating)
    whole = float(held + setup.loss_bytes_per_output_element * sum(meta.numel for meta in floating))
    if setup.runtime.local_outputs:
        return whole / num_devices
    shape = (num_devices,) if mesh_shape is None else mesh_shape
    return whole / setup.loss_rows(shape, num_microbatches=num_microbatches)


def with_loss(table: LayerTable, extra_bytes: float) -> LayerTable:
    """``table`` with ``extra_bytes`` added to every option's state (held once per stage, not per microbatch in
    flight): the model outputs and the loss (:func:`loss_and_output_bytes`). The loss's tensors include the gradient
    it hands back, so the layer's peak beyond what it keeps (its outputs' gradients first) counts only past them."""
    if not extra_bytes:
        return table
    options = tuple(
        None
        if o is None
        else replace(
            o, state_bytes=o.state_bytes + extra_bytes, peak_extra_bytes=max(0.0, o.peak_extra_bytes - extra_bytes)
        )
        for o in table.options
    )
    return replace(table, options=options)
