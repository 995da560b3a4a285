"""One number per quantity: every method's plan checked against what every command prints for it.

For one prepared model (:func:`planner.api.prepare`), :func:`check_case` plans with every method and returns the
violations of these rules (an empty list when none is broken):

* **the breakdown is the step**: each plan's ``estimate.breakdown_s`` parts are non-negative and add up to its step
  (:meth:`planner.plan.Estimate.breakdown_error`); the work hidden behind them is non-negative;
* **one estimate per candidate**: auto's plan is the least estimate of its candidates, and its data-parallel,
  Megatron and uniform-pipeline candidates are exactly the plans those methods return run alone (or the method
  fails where auto has no such candidate); the summary's "why this plan" line prints those same figures, and
  ``plan compare`` rows carry the plan's own estimate;
* **auto is never slower** than a method whose plan it holds (true by construction: it takes the least estimate);
* **the JSON reads the same numbers**: a plan round-trips through JSON to an equal plan;
* **each stage's trade-off line has the right sign** (:func:`tradeoff_problems`): the plan replayed with the stage
  on the recomputation and ZeRO level its line names as the next best (when that fits) is not faster.

:func:`check_options` plans with each method under each forced option (``--remat``, ``--zero``,
``--microbatches``, ``--schedule``) and checks that the plan honours it — every stage's recomputation, ZeRO
level, the microbatch count and schedule are the ones asked for — or that the method refuses it with one
:class:`planner.errors.AutoplanError`.

``tests/test_consistency.py`` runs both on a CI slice; this script runs them over every quality case
(``benchmarks/quality_cases.py``'s) and saves a page::

    python -m benchmarks.consistency [--cases mlp@a100x8,...] [--save]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from planner.api import Prepared, plan_prepared
from planner.errors import AutoplanError
from planner.methods import AutoSearch, search_auto
from planner.plan import Plan
from planner.plan.report import plan_summary

ROOT = Path(__file__).resolve().parent.parent

FAMILIES = ("data-parallel", "megatron", "uniform-pipeline")
METHODS = ("auto", *FAMILIES, "hash", "critical-path")
FORCED_OPTIONS: tuple[Mapping[str, object], ...] = (
    {"remat": "off"},
    {"remat": "attention"},
    {"remat": "full"},
    {"zero": "0"},
    {"zero": "1"},
    {"zero": "3"},
    {"microbatches": 2},
    {"schedule": "gpipe"},
    {"schedule": "1f1b"},
    {"schedule": "interleaved"},
)
REMAT_KINDS = {"off": {"none"}, "attention": {"attention", "none"}, "full": {"full", "none"}}


def _plan(prepared: Prepared, method: str, search: AutoSearch | None = None) -> Plan | str:
    """The plan (auto's from ``search`` when given), or the one-line refusal."""
    try:
        return plan_prepared(prepared, method, search=search)
    except AutoplanError as error:
        message = str(error)
        return message if "\n" not in message else f"MULTI-LINE ERROR: {message!r}"


def _plan_problems(method: str, plan: Plan) -> list[str]:
    problems = []
    error = plan.estimate.breakdown_error()
    if error:
        problems.append(f"{method}: breakdown: {error}")
    negative = {key: value for key, value in plan.estimate.hidden_s.items() if value < 0}
    if negative:
        problems.append(f"{method}: negative hidden work {negative}")
    if not plan.estimate.step_time_s > 0:
        problems.append(f"{method}: step {plan.estimate.step_time_s}")
    if Plan.from_json(json.loads(plan.dumps())) != plan:
        problems.append(f"{method}: the plan does not round-trip through JSON")
    return problems


def tradeoff_problems(method: str, plan: Plan, prepared: Prepared) -> list[str]:
    """A stage's recomputation/ZeRO line must have the sign of the change it names: the plan replayed with that
    stage on its next-best pair (when that fits) is slower by about what the line says it saved, never faster
    by more than 1% of the step."""
    from planner.costing.lowering import lower_plan, simulate_lowered
    from planner.ir.graph import subgraph
    from planner.ir.layers import graph_layers
    from planner.ir.recompute import remat_runs

    graph = prepared.graphs.at(plan.batch_size // plan.num_microbatches)
    base = simulate_lowered(lower_plan(plan, graph, prepared.setup)).step_time_s
    problems = []
    for stage in plan.stages:
        saving = stage.memory_saving
        if saving is None or "does not fit" in saving.next_best:
            continue
        kind, level = str(saving.next_best_remat), saving.next_best_zero
        part = subgraph(graph, list(stage.nodes))
        layers = [tuple(name for name in layer if name in set(stage.nodes)) for layer in graph_layers(graph)]
        runs = remat_runs(kind, part, list(stage.nodes), layers=[layer for layer in layers if layer])
        other = replace(
            stage, remat=kind if runs else "none", remat_regions=tuple((r[0], r[-1]) for r in runs), zero=level
        )
        changed = replace(plan, stages=tuple(other if s.index == stage.index else s for s in plan.stages))
        replayed = simulate_lowered(lower_plan(changed, graph, prepared.setup)).step_time_s - base
        if replayed < -0.01 * base and float(saving["saved_s"]) >= 0:
            problems.append(
                f"{method}: stage {stage.index} says {saving['choice']} saves {saving['saved_s']:.3g} s "
                f"against {saving['next_best']}, which replays {-replayed:.3g} s faster"
            )
    return problems


def check_case(prepared: Prepared, methods: Sequence[str] = METHODS) -> list[str]:
    """Violations of the one-number rules (module docstring) on one prepared model."""
    try:
        search = search_auto(prepared) if "auto" in methods else None
    except AutoplanError:
        search = None
    plans = {method: _plan(prepared, method, search) for method in methods}
    problems = [f"{method}: {plan}" for method, plan in plans.items() if isinstance(plan, str) and "MULTI" in plan]
    for method, plan in plans.items():
        if isinstance(plan, Plan):
            problems += _plan_problems(method, plan)
            if plan.schedule != "dataflow":
                problems += tradeoff_problems(method, plan, prepared)
    auto = plans.get("auto")
    if not isinstance(auto, Plan) or search is None:
        return problems
    result = search.result
    least = min(candidate.estimate.step_time_s for candidate in result.priced.values())
    if auto.estimate.step_time_s != least:
        problems.append(f"auto: its step {auto.estimate.step_time_s!r} is not its candidates' least {least!r}")
    summary = plan_summary(auto)
    for family in FAMILIES:
        alone = plans.get(family)
        held = result.priced.get(family)
        if alone is None:
            continue
        if held is None and isinstance(alone, Plan):
            problems.append(f"{family}: runs alone ({alone.estimate.step_time_s:.4g} s) but auto holds no candidate")
        if held is not None and not isinstance(alone, Plan):
            problems.append(f"{family}: auto holds a candidate but the method alone fails: {alone}")
        if held is None or not isinstance(alone, Plan):
            continue
        without_sp = [replace(stage, sequence_parallel_saving=None) for stage in alone.stages]  # added to the plan
        if held.estimate != alone.estimate or list(held.stages) != without_sp:
            problems.append(
                f"{family}: auto's candidate ({held.estimate.step_time_s!r} s) is not the method's plan "
                f"({alone.estimate.step_time_s!r} s)"
            )
        if f"{alone.estimate.step_time_s:.4g} s" not in summary:
            problems.append(f"{family}: 'why this plan' does not print its estimate {alone.estimate.step_time_s:.4g} s")
        if auto.estimate.step_time_s > alone.estimate.step_time_s:
            problems.append(f"auto ({auto.estimate.step_time_s:.4g} s) is slower than {family}")
    return problems


def _honoured(plan: Plan, forced: Mapping[str, object]) -> str | None:
    """Why ``plan`` does not honour ``forced``; None when it does."""
    if "remat" in forced:
        kinds = REMAT_KINDS[str(forced["remat"])]
        wrong = [stage.index for stage in plan.stages if stage.remat not in kinds]
        if plan.schedule != "dataflow" and wrong:
            return f"stages {wrong} recompute {[plan.stages[i].remat for i in wrong]}"
    if "zero" in forced:
        level = int(str(forced["zero"]))
        wrong = [stage.index for stage in plan.stages if len(stage.devices) > 1 and stage.zero != level]
        if plan.schedule != "dataflow" and wrong:
            return f"stages {wrong} run ZeRO levels {[plan.stages[i].zero for i in wrong]}"
    if "microbatches" in forced and plan.num_microbatches != forced["microbatches"]:
        return f"{plan.num_microbatches} microbatches"
    if "schedule" in forced:  # a pipeline's order: a plan of one stage and one microbatch has none to follow
        asked = forced["schedule"]
        same = (
            plan.schedule == asked
            or (asked == "1f1b" and plan.schedule == "gpipe" and plan.num_microbatches < plan.num_pipeline_ranks)
            or (asked in ("gpipe", "1f1b") and plan.schedule == "none")
        )
        if not same:
            return f"schedule {plan.schedule}"
    return None


def check_options(
    prepared_with: Callable[[Mapping[str, object]], Prepared],
    methods: Sequence[str] = METHODS,
    forced_options: Sequence[Mapping[str, object]] = FORCED_OPTIONS,
) -> list[str]:
    """Each method under each forced option honours it or refuses it in one line (module docstring);
    ``prepared_with(options)``: the model prepared with those planner options."""
    problems = []
    for forced in forced_options:
        prepared = prepared_with(forced)
        for method in methods:
            plan = _plan(prepared, method)
            label = ", ".join(f"--{key} {value}" for key, value in forced.items())
            if isinstance(plan, str):
                if "MULTI" in plan:
                    problems.append(f"{method} with {label}: {plan}")
                continue
            problems += [f"{method} with {label}: {problem}" for problem in _plan_problems(method, plan)]
            why = _honoured(plan, forced)
            if why is not None:
                problems.append(f"{method} with {label}: not honoured: {why}")
    return problems


def with_options(prepared: Prepared, forced: Mapping[str, object]) -> Prepared:
    """``prepared`` with planner options forced, its capture shared (no search run yet)."""
    return replace(prepared, options=replace(prepared.options, **forced))


def _quality_case(name: str, **options: object) -> Prepared:
    from benchmarks.quality_cases import CLUSTERS, DEVICES_PER_NODE, MODELS
    from cost_models.cluster import load_cluster
    from planner.api import prepare_model_file

    model, at = name.split("@")
    cluster_key, gpus = at.split("x")
    example, args, batch = MODELS[model]
    cluster = load_cluster(CLUSTERS[cluster_key], num_nodes=max(1, int(gpus) // DEVICES_PER_NODE))
    return prepare_model_file(
        ROOT / "examples" / f"{example}.py", cluster, batch_size=batch, model_args=args, rl_iterations=5, **options
    )


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.quality_cases import CASES
    from benchmarks.results_page import save_table

    parser = argparse.ArgumentParser(prog="python -m benchmarks.consistency", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated MODEL@CLUSTERxGPUS (quality.py's)")
    parser.add_argument("--no-options", action="store_true", help="skip the forced-option checks (the slow part)")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/consistency-DATE.md")
    args = parser.parse_args(argv)
    rows = []
    for name in args.cases.split(","):
        started = time.perf_counter()
        base = _quality_case(name)
        problems = check_case(base)
        if not args.no_options:
            problems += check_options(lambda forced, base=base: with_options(base, forced), methods=("auto", *FAMILIES))
        seconds = time.perf_counter() - started
        rows.append((name, len(problems), "; ".join(problems) or "-", f"{seconds:.0f}"))
        print(f"{name}: {len(problems)} problem(s) in {seconds:.0f} s" + "".join(f"\n  {p}" for p in problems))
    failed = sum(1 for row in rows if row[1])
    print(f"{len(rows) - failed} of {len(rows)} cases consistent")
    if args.save:
        command = "python -m benchmarks.consistency " + " ".join(argv if argv is not None else sys.argv[1:])
        table = "| case | problems | what | seconds |\n|---|---:|---|---:|\n" + "\n".join(
            f"| {name} | {count} | {what} | {seconds} |" for name, count, what, seconds in rows
        )
        save_table(
            "consistency",
            title="One number per quantity: every method against every command",
            command=command,
            description=f"{__doc__.split(chr(10) * 2)[1]}\n\n**{len(rows) - failed} of {len(rows)} cases consistent.**",
            table=table,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
