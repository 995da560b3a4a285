"""Stage problems keyed by the stage's shape, built once and reused at every position of a pipeline.

The exact price of a candidate (:mod:`planner.inter.pricing`) solves nothing new per stage, but
building a stage's problem (every node's strategies and resharding costs) takes ~20 ms per layer;
GPT-1T at pipeline 64 has 64 stages, and the candidates repeat them. Two stages cost the same when

* their subgraphs are the same up to names: the same operators on the same shapes, wired the same
  way, the same values leaving the stage (:func:`shape_key`, :func:`planner.ir.layers.structural_hash`);
* they run the same layer slot on the same submesh and logical mesh at the same microbatch count;
* their devices are laid out the same way: :func:`planner.inter.stage_dp.device_blocks.assign_devices` puts
  a whole-node submesh on whole nodes and a ``(1, m)`` block aligned inside one node, so every
  mesh axis sees the same links wherever the stage sits. The template is built on ranks
  ``0..|j|−1`` (:func:`planner.inter.search.canonical_mesh`).

So :class:`StageShapes` keeps one :class:`StageTemplate` per key — the problem, its composed choice
and, on demand, its unconstrained optimum and each choice's split costs — and
:func:`relabel` turns the template's plan stage into the stage at hand: node names, parameter
names and explanation rows mapped position by position, devices set to the stage's ranks. What a priced stage
picked on its template travels with the candidate as a :class:`StageChoice`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from planner.costing.setup import CostSetup
from planner.inter.layer_costs import split_costs
from planner.intra.ilp import solve_unconstrained
from planner.intra.problem import evaluate
from planner.intra.stage_problem import StageProblem, ZeroCosts, kept_bytes, recompute_s, zero_costs
from planner.intra.to_stage import stage_of_choice
from planner.ir.graph import OpGraph, ValueKind
from planner.ir.layers import structural_hash
from planner.ir.recompute import REMAT_KINDS, remat_runs
from planner.plan import Stage
from planner.plan.stage import MemorySaving, as_remat, memory_choice_label


def shape_key(part: OpGraph) -> tuple[str, tuple[int, ...]]:
    """What a stage subgraph's problem depends on, names aside: its structure and which nodes leave it."""
    position = {node.name: index for index, node in enumerate(part.nodes)}
    return structural_hash(part, "", list(part.nodes)), tuple(position[name] for name in part.outputs)


@dataclass(kw_only=True)
class StageTemplate:
    """One stage problem on canonical ranks (``part``: the subgraph it was built from) and what pricing
    reads off it, each computed once per choice."""

    part: OpGraph
    problem: StageProblem
    composed: tuple[int, ...]
    layers: tuple[tuple[str, ...], ...] = ()  # the stage's layers (node names): full recomputation's runs
    _unconstrained: tuple[int, ...] | None = None
    _costs: dict[tuple[int, ...], tuple[float, float, float, float, float]] = field(default_factory=dict)
    _stages: dict[tuple[tuple[int, ...], str, int], Stage] = field(default_factory=dict)
    _recompute: dict[tuple[tuple[int, ...], str], tuple[float, float]] = field(default_factory=dict)
    _zero: dict[tuple[tuple[int, ...], int], ZeroCosts] = field(default_factory=dict)
    memo: dict[tuple, object] = field(default_factory=dict)  # other per-choice figures (gradient sync)

    def unconstrained(self) -> tuple[int, ...]:
        """The stage's exact optimum without a memory limit (:func:`solve_unconstrained`)."""
        if self._unconstrained is None:
            self._unconstrained = solve_unconstrained(self.problem.problem).choice
        return self._unconstrained

    def costs(self, choice: tuple[int, ...]) -> tuple[float, float, float, float, float]:
        """(objective s, step s, state bytes, activation bytes, compute s) of ``choice``; step s is the
        gradient sync and optimizer update, once per step."""
        if choice not in self._costs:
            objective, _ = evaluate(self.problem.problem, choice)
            state, activation, compute = split_costs(self.problem, choice)
            self._costs[choice] = (objective, step_s(self.problem, choice), state, activation, compute)
        return self._costs[choice]

    def runs(self, remat: str) -> tuple[tuple[str, ...], ...]:
        """The runs recomputation ``remat`` checkpoints (:func:`planner.ir.recompute.remat_runs`)."""
        return remat_runs(str(remat), self.part, [node.name for node in self.part.nodes], layers=self.layers)

    def _recomputed(self, choice: tuple[int, ...], remat: str) -> tuple[float, float]:
        if (choice, remat) not in self._recompute:
            runs = self.runs(remat)
            self._recompute[choice, remat] = (
                recompute_s(self.problem, choice, runs),
                kept_bytes(self.problem, choice, runs),
            )
        return self._recompute[choice, remat]

    def forward_s(self, choice: tuple[int, ...]) -> float:
        """Seconds of the stage's whole forward (:func:`planner.intra.stage_problem.recompute_s` of every node)."""
        if (choice, "forward") not in self._recompute:
            self._recompute[choice, "forward"] = (recompute_s(self.problem, choice), 0.0)
        return self._recompute[choice, "forward"][0]

    def recompute_s(self, choice: tuple[int, ...], remat: str = "full") -> float:
        """Seconds to recompute the runs of ``remat`` once (:func:`planner.intra.stage_problem.recompute_s`)."""
        return 0.0 if remat == "none" else self._recomputed(choice, remat)[0]

    def recompute_bytes(self, choice: tuple[int, ...], remat: str = "full") -> float:
        """Activations kept per microbatch under ``remat`` (:func:`planner.intra.stage_problem.kept_bytes`)."""
        return self.costs(choice)[3] if remat == "none" else self._recomputed(choice, remat)[1]

    def zero(self, choice: tuple[int, ...], level: int, setup: CostSetup) -> ZeroCosts:
        """``choice`` at ZeRO ``level`` (:func:`planner.intra.stage_problem.zero_costs`)."""
        if (choice, level) not in self._zero:
            self._zero[choice, level] = zero_costs(self.problem, choice, level=level, setup=setup)
        return self._zero[choice, level]

    def memory_saving(
        self,
        choice: tuple[int, ...],
        *,
        remat: str,
        zero: int,
        levels: tuple[int, ...],
        m: int,
        in_flight: int,
        setup: CostSetup,
    ) -> MemorySaving | None:
        """What the stage's recomputation and ZeRO level save, per step and per device, against the next-best pair:
        the fastest other pair that fits, or the fastest other one (said not to fit); None: no other pair. Priced on
        the stage's problem: the recomputed forward and FSDP's per-microbatch collectives ``m`` times, ZeRO's
        per-step terms once, memory with ``in_flight`` microbatches (kept activations, state at the level)."""

        if remat != "none" and not self.runs(remat):  # nothing to recompute: the stage runs without it
            remat = "none"

        def price(kind: str, level: int) -> tuple[float, float]:
            seconds = m * self.recompute_s(choice, kind)
            state = self.costs(choice)[2]
            if level:
                costs = self.zero(choice, level, setup)
                seconds, state = seconds + m * costs.per_microbatch_s + costs.step_s, costs.state_bytes
            return seconds, state + self.recompute_bytes(choice, kind) * in_flight

        chosen_s, chosen_bytes = price(remat, zero)
        others = [
            (kind, level, *price(kind, level))
            for kind in REMAT_KINDS
            for level in levels
            if (kind, level) != (remat, zero) and (kind != "attention" or self.runs(kind))
        ]
        # an identical alternative (ZeRO where nothing syncs over data-parallel axes, as on one device) is no option
        others = [other for other in others if not _same(other[2:], (chosen_s, chosen_bytes))]
        if not others:
            return None
        budget = setup.memory_budget_bytes
        kind, level, seconds, memory = min(others, key=lambda other: (other[3] > budget, other[2]))
        return MemorySaving(
            choice=memory_choice_label(remat, zero),
            next_best=memory_choice_label(kind, level) + (" (does not fit)" if memory > budget else ""),
            saved_s=seconds - chosen_s,
            saved_bytes=memory - chosen_bytes,
            next_best_remat=as_remat(kind),
            next_best_zero=level,
        )

    def stage(self, choice: tuple[int, ...], *, remat: str, explain: Callable[[Stage], tuple], zero: int = 0) -> Stage:
        """The plan stage of ``choice`` on the template's names and canonical ranks, explained by ``explain``."""
        if (choice, remat, zero) not in self._stages:
            base = stage_of_choice(self.problem, choice)
            regions = tuple((run[0], run[-1]) for run in self.runs(remat))
            base = replace(base, remat=remat if regions else "none", remat_regions=regions, zero=zero)
            self._stages[choice, remat, zero] = replace(base, explanation=explain(base))
        return self._stages[choice, remat, zero]


def _same(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return all(math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-15) for x, y in zip(a, b, strict=True))


def step_s(problem: StageProblem, choice: tuple[int, ...]) -> float:
    """Gradient sync and optimizer update of the stage's choice, once per step."""
    total = 0.0
    for node in problem.graph.nodes:
        variable = problem.variables.index(problem.representative[node.name])
        total += problem.costs[variable][choice[variable]].step_s
    return total


@dataclass(frozen=True, kw_only=True)
class StageChoice:
    """What the search picked for one stage of a priced candidate: the variable ``choice`` on ``template``'s problem
    (the stage's strategies are its strategies, as stored), and the stage's node names to the template's
    (``names``). The plan's finishing touches read it instead of re-solving (:mod:`planner.inter.sp_saving`)."""

    template: StageTemplate
    choice: tuple[int, ...]
    names: Mapping[str, str]  # the stage's node name -> the template's


class StageShapes:
    """:class:`StageTemplate` per (shape key, submesh, mesh shape, slot, microbatches)."""

    def __init__(self) -> None:
        self._templates: dict[tuple, StageTemplate] = {}
        self.num_built = 0
        self.num_reused = 0

    def get(self, key: tuple, build: Callable[[], StageTemplate]) -> StageTemplate:
        if key in self._templates:
            self.num_reused += 1
        else:
            self._templates[key] = build()
            self.num_built += 1
        return self._templates[key]


def relabel(template: Stage, template_graph: OpGraph, part: OpGraph, *, devices: tuple[int, ...], index: int) -> Stage:
    """``template`` (a plan stage of ``template_graph``) as the stage of ``part``, a subgraph of the same
    shape key, on ``devices``."""
    if template_graph is part:
        return replace(template, devices=devices, index=index)
    names = dict(zip((n.name for n in template_graph.nodes), (n.name for n in part.nodes), strict=True))
    params: dict[str, str] = {}
    for ours, theirs in zip(template_graph.nodes, part.nodes, strict=True):
        for mine, other in zip(ours.inputs, theirs.inputs, strict=True):
            if template_graph.value_kind(mine) == ValueKind.PARAM:
                params[mine] = other
    placements: Mapping[str, tuple[str, ...]] = {params[name]: spec for name, spec in template.param_placements.items()}
    return replace(
        template,
        index=index,
        nodes=tuple(names[name] for name in template.nodes),
        devices=devices,
        strategies={names[name]: record for name, record in template.strategies.items()},
        param_placements=placements,
        explanation=tuple(replace(row, node=names[row.node]) for row in template.explanation),
        remat_regions=tuple((names[first], names[last]) for first, last in template.remat_regions),
    )
