"""``plan show PLAN.json [--figure out.png] [--json]``: what a plan does, in words, numbers and a figure.

The plan's model is rebuilt from its model file (on the meta device), captured at the full batch
(its fingerprint must be the plan's) and at the microbatch size, and the plan is replayed by the
discrete-event simulator (:func:`planner.costing.lowering.simulate_plan`, roofline compute times on the
plan's cluster): the simulated step and peak memory per device are printed in the plan's summary
(:func:`planner.plan.report.plan_summary`, after its estimate; under DGA with its gradient communication split
into what the next ``D`` steps hide and what the step waits for, :func:`planner.costing.sync.delayed.sync_timeline`)
with the choices each stage uses and what each saved (:mod:`planner.plan.choices`), or as JSON with ``--json``. The
pipeline bubble printed is the plan's, the one ``plan`` and ``plan compare`` print. ``--figure``
draws the plan on its device grid and the simulated step as a Gantt chart
(:mod:`planner.cli.plan_figure`). Bad input is one error line and exit 2, and writes nothing.

A plan made from Python (:func:`planner.api.plan`) names no model file to rebuild: ``plan show`` prints its
summary and choices, says first that it cannot replay it (:data:`NO_MODEL_FILE`), gives ``null`` simulated figures
with ``--json`` and refuses ``--figure`` (the timeline is the replay's).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cost_models.simulator import SimResult
from cost_models.units import GIB, MIB
from planner.costing.sync.delayed import sync_timeline
from planner.errors import AutoplanError
from planner.ir.graph import OpGraph
from planner.plan import Plan, Stage
from planner.plan.choices import plan_choices
from planner.plan.report import headroom_bytes

if TYPE_CHECKING:
    from planner.ir.model_file import ModelFile

NO_MODEL_FILE = (
    "the plan names no model file (it was planned from Python), so it cannot be replayed: no simulated step, peak "
    "memory or figure; its summary and choices follow (plan the model with `plan MODEL_FILE ...` to replay it)"
)


def _parser() -> argparse.ArgumentParser:
    from planner.cli.options import plan_file_parser

    parser = plan_file_parser(
        prog="plan show",
        description=(
            "Summarise a plan and replay it in the discrete-event simulator (roofline compute times on the plan's "
            "cluster): simulated step time and peak memory per device, beside the plan's estimate and pipeline bubble. "
            "--figure draws the stages on the "
            "device grid with their meshes and a per-device timeline of the simulated step. The plan's model file "
            "is rebuilt and checked against the plan's fingerprint."
        ),
    )
    parser.add_argument("--figure", default=None, metavar="OUT.png", help="draw the plan and its timeline as a PNG")
    parser.add_argument("--json", action="store_true", help="print stages and simulated numbers as JSON")
    return parser


def run_show(argv: Sequence[str]) -> int:
    from planner.cli.choices_table import choices_text
    from planner.cli.options import figure_path
    from planner.plan import load_plan
    from planner.plan.report import plan_summary

    options = _parser().parse_args(list(argv))
    figure = figure_path(options.figure)
    plan = load_plan(options.plan)
    if plan.model.file is None:
        return _show_without_model(plan, plan_path=options.plan, figure=figure, as_json=options.json)
    result = simulate_recorded(plan)
    if figure is not None:
        from planner.cli.plan_figure import draw_plan

        draw_plan(plan, result, figure)
    if options.json:
        print(json.dumps(show_json(plan, result), indent=2))
        return 0
    if figure is not None:
        print(f"wrote {figure}")
    print(
        plan_summary(
            plan,
            plan_path=options.plan,
            simulated_line=simulated_line(plan, result),
            choices=choices_text(plan_choices(plan)),
        )
    )
    return 0


def _show_without_model(plan: Plan, *, plan_path: str, figure: Path | None, as_json: bool) -> int:
    """``plan show`` of a plan with no model file: everything but the replay (:data:`NO_MODEL_FILE`)."""
    from planner.cli.choices_table import choices_text
    from planner.plan.report import plan_summary

    if figure is not None:
        raise AutoplanError(
            "--figure draws the plan's replay, and the plan names no model file to replay (it was planned from "
            "Python): plan the model with `plan MODEL_FILE ...`, or drop --figure"
        )
    if as_json:
        print(json.dumps(show_json(plan, None), indent=2))
        return 0
    print(f"plan show: {NO_MODEL_FILE}")
    print(plan_summary(plan, plan_path=plan_path, choices=choices_text(plan_choices(plan))))
    return 0


def simulate_recorded(plan: Plan) -> SimResult:
    """The plan's step in the simulator with every task's span, on the graph at its microbatch size."""
    graph = microbatch_graph(plan)  # first: its cheap checks fail before torch is imported
    from planner.costing.lowering import simulate_plan
    from planner.costing.setup import plan_setup

    return simulate_plan(plan, graph, plan_setup(plan), record=True)


def microbatch_graph(plan: Plan) -> OpGraph:
    """Rebuild the plan's model, check it is the planned one, and capture it at the microbatch size."""
    if plan.model.file is None:
        raise AutoplanError("the plan has no model file (it was planned from Python): plan it with the `plan` command")
    path = Path(plan.model.file)
    if not path.is_file():
        raise AutoplanError(
            f"the plan's model file {path} does not exist: run `plan show` from the directory the plan "
            "was made in, or re-plan the model"
        )
    from planner.costing.stage_work import check_plan_strategies
    from planner.ir.model_file import load_model_file  # imports torch: after the cheap checks
    from planner.plan import validate_plan

    model_file = load_model_file(path)
    full = _capture_at(plan, model_file, plan.batch_size)
    if full.fingerprint() != plan.model.fingerprint:
        raise AutoplanError(
            f"model fingerprint mismatch: the plan was made for model {plan.model.fingerprint}, but {path} with "
            f"{dict(plan.model.args)} builds {full.fingerprint()}; re-plan the model"
        )
    validate_plan(plan, full)
    size = plan.batch_size // plan.num_microbatches
    graph = full if size == plan.batch_size else _capture_at(plan, model_file, size)
    if [(n.name, n.target) for n in graph.nodes] != [(n.name, n.target) for n in full.nodes]:
        raise AutoplanError(
            f"the model captured at microbatch size {size} has different operators from the planned "
            "capture: make the model's graph independent of the batch size"
        )
    check_plan_strategies(plan, graph)  # a hand-edited strategy is refused, not guessed at
    return graph


def _capture_at(plan: Plan, model_file: ModelFile, batch_size: int) -> OpGraph:
    from planner.ir.capture import capture
    from planner.ir.model_file import instantiate

    model, inputs = instantiate(model_file, batch_size=batch_size, model_args=dict(plan.model.args))
    return capture(model, inputs, tracer=plan.model.tracer, reuse_layers=True)


def stage_json(stage: Stage) -> dict[str, Any]:
    sharded = sum(any(p.startswith("S") for p in spec) for spec in stage.param_placements.values())
    return {
        "index": stage.index,
        "devices": list(stage.devices),
        "mesh_shape": list(stage.mesh_shape),
        "num_operators": len(stage.nodes),
        "num_params": len(stage.param_placements),
        "num_params_sharded": sharded,
        "remat": str(stage.remat),
        "zero": stage.zero,
        "memory_saving": None if stage.memory_saving is None else stage.memory_saving.to_json(),
        "sequence_parallel_saving": None
        if stage.sequence_parallel_saving is None
        else stage.sequence_parallel_saving.to_json(),
    }


def show_json(plan: Plan, result: SimResult | None) -> dict[str, Any]:
    """The stages, estimate, Megatron-LM terms and choices; the simulated figures None without a replay."""
    return {
        "method": plan.method,
        "num_microbatches": plan.num_microbatches,
        "schedule": plan.schedule,
        "stages": [stage_json(stage) for stage in sorted(plan.stages, key=lambda s: s.index)],
        "estimated_step_time_s": plan.estimate.step_time_s,
        "simulated_step_time_s": None if result is None else result.step_time_s,
        "bubble_fraction": plan.estimate.bubble_fraction,  # the plan's pipeline bubble, as plan prints it
        "peak_memory_bytes": None if result is None else result.max_memory_bytes,
        "headroom_bytes": headroom_bytes(plan),  # the budget less the estimate, on the fullest device
        "choices": plan_choices(plan).to_json(),  # each stage's choices and savings (planner.plan.choices)
        "megatron": plan.megatron.to_json(),  # the plan in Megatron-LM's terms (planner.plan.megatron_terms)
    }


def simulated_line(plan: Plan, result: SimResult) -> str:
    estimate = plan.estimate.step_time_s
    versus = f" ({result.step_time_s / estimate - 1:+.0%} vs the estimate)" if estimate > 0 else ""
    line = (
        f"simulated: step {result.step_time_s:.4g} s{versus}, peak {_size(result.max_memory_bytes)} per device "
        "(discrete-event simulator, roofline compute times)"
    )
    if plan.grad_sync.kind == "dga" or plan.grad_sync.staleness:  # part of it behind the next D (K) steps
        delay = plan.grad_sync.delay or plan.grad_sync.staleness
        line += f"; gradient sync: {sync_timeline(result).describe(delay=delay)}"
    return line


def _size(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= 0.1 * GIB else f"{num_bytes / MIB:.1f} MiB"
