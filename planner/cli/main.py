"""The ``plan`` command.

``plan MODEL_FILE --cluster NAME|FILE --batch-size B ...`` plans a model; subcommands
``profile``, ``calibrate``, ``compare``, ``tune``, ``run``, ``compile`` and ``show`` stand beside it.
Every user error is one line on stderr and exit code 2; no output file is written unless the
whole command succeeded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from planner.cli.options import (
    EXIT_INTERNAL,
    EXIT_USAGE,
    UsageParser,
    add_cluster_options,
    add_model_options,
    add_search_options,
    model_cluster,
    one_line_warnings,
    plan_options,
    prepare_from_options,
)
from planner.errors import AutoplanError, InternalError
from planner.plan import Plan

SUBCOMMANDS = ("profile", "calibrate", "compare", "tune", "run", "compile", "show")
_DESCRIPTION = """\
Find how to train a PyTorch model on a cluster: pipeline stages, per-operator sharding and
data parallelism, with an estimate of step time and memory per device.

  plan MODEL_FILE --cluster NAME|FILE --batch-size B [options]   plan a model (this form)
  plan profile MODEL_FILE --batch-size B [options]               per-node FLOPs, time, memory
  plan calibrate [--out FILE]                                    measure this machine
  plan compare MODEL_FILE --cluster NAME|FILE --batch-size B     every method by the estimate it prints
  plan tune MODEL_FILE --cluster NAME|FILE --batch-size B        run the best candidates here, keep the fastest
  plan run PLAN.json [--steps N] [--check-parity]                 train with the plan on this machine
  plan compile PLAN.json --out DIR                                write DIR/train.py for torchrun
  plan show PLAN.json [--figure OUT.png] [--json]                 summary, simulated step, figure

A model file defines build_model(**kwargs) -> nn.Module and example_inputs(batch_size) -> tuple
of tensors, optionally example_targets(batch_size) -> labels and loss_fn(output, targets) (or
loss_fn(output, inputs) without targets); see examples/ and examples/zoo/. Clusters: local-cpu,
p3.16xlarge, dgx-2h, dgx-a100, dgx-h100, or a .toml/.json file (`plan calibrate` writes one).
Run `plan SUBCOMMAND --help` for a subcommand's options."""


def _plan_parser() -> argparse.ArgumentParser:
    from planner.api import METHODS

    parser = UsageParser(
        prog="plan",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_options(parser)
    add_cluster_options(parser, required=True)
    methods = "; ".join(f"{name}: {method.description}" for name, method in METHODS.items())
    parser.add_argument("--method", default="auto", choices=[name.value for name in METHODS], metavar="M", help=methods)
    add_search_options(parser)
    parser.add_argument(
        "--explain",
        action="store_true",
        help="print each stage's choices (schedule, recomputation, "
        "ZeRO, sequence parallelism, gradient sync) and what each saved, then each node's split, spec "
        "and seconds",
    )
    parser.add_argument(
        "--out", default="plan.json", metavar="FILE", help="where to write the plan (default plan.json)"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of a summary")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``plan`` console script; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        with one_line_warnings():
            if args and args[0] in SUBCOMMANDS:
                return _run_subcommand(args[0], args[1:])
            return _run_plan(_plan_parser().parse_args(args))
    except AutoplanError as error:
        sys.stderr.write(f"plan: error: {error}\n")
        return EXIT_USAGE
    except InternalError as error:
        sys.stderr.write(f"plan: internal error: {error}\n")
        return EXIT_INTERNAL
    except KeyboardInterrupt:
        sys.stderr.write("plan: interrupted\n")
        return 130


def _run_subcommand(name: str, args: list[str]) -> int:
    if name == "profile":
        from planner.cli.profile import run_profile

        return run_profile(args)
    if name == "compare":
        from planner.cli.compare import run_compare

        return run_compare(args)
    if name == "tune":
        from planner.cli.tune import run_tune

        return run_tune(args)
    if name in ("run", "compile"):
        from planner.cli.run import run_compile, run_run

        return run_run(args) if name == "run" else run_compile(args)
    if name == "show":
        from planner.cli.show import run_show

        return run_show(args)
    from planner.cli.calibrate import run_calibrate

    return run_calibrate(args)


def _run_plan(options: argparse.Namespace) -> int:
    from planner.api import plan_prepared
    from planner.plan import save_plan
    from planner.plan.report import plan_summary

    chosen = plan_options(options, method=options.method)  # checked before any capture or calibration
    cluster = model_cluster(options)
    bar, progress = _progress_bar(f"capturing {options.model_file} for {cluster.num_devices} devices")
    with bar:
        result = plan_prepared(prepare_from_options(options, cluster=cluster, chosen=chosen, progress=progress))
    out = Path(options.out)
    save_plan(result, out)
    if options.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(f"wrote {out}")
        print(plan_summary(result, plan_path=str(out)))
    if options.explain:
        _print_explanation(result)
    return 0


def _progress_bar(first: str):
    """A transient bar on stderr (none off a terminal), one per phase of the search, and the ``progress``
    callback that drives it (:data:`planner.inter.search.Progress`)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
    )
    console = Console(stderr=True)
    bar = Progress(*columns, console=console, transient=True, disable=not console.is_terminal)
    phase = {"task": bar.add_task(first, total=None), "what": "capture"}

    def progress(what: str, done: int, total: int) -> None:
        """One bar per phase (layer options per microbatch count, pricing, ...), so its ETA is that phase's."""
        if what != phase["what"]:
            bar.remove_task(phase["task"])
            phase["task"], phase["what"] = bar.add_task(what, total=total), what
        bar.update(phase["task"], completed=done, total=total)

    return bar, progress


def _print_explanation(result: Plan) -> None:
    from rich.console import Console

    from planner.cli.choices_table import choices_table
    from planner.cli.explain_table import explain_table
    from planner.plan.choices import plan_choices

    console = Console(width=200, stderr=False)
    console.print(choices_table(plan_choices(result)))
    for stage in result.stages:
        if not stage.explanation:
            console.print(f"stage {stage.index}: {result.method} has no per-node explanation")
            continue
        rows = list(stage.explanation)
        mesh = "×".join(str(size) for size in stage.mesh_shape)
        console.print(explain_table(rows, title=f"stage {stage.index} on mesh {mesh}: split per mesh axis"))


def entry() -> NoReturn:
    """The console script. After a plan search (not a subcommand) the process leaves without tearing
    its heap down object by object: the graphs, tables and stage problems of a large model take about
    a second to free (GPT-1T), and the operating system reclaims them at once. Output is flushed first;
    the search leaves no child process or temporary file behind (children are joined, the plan file is
    written atomically), so nothing waits for exit handlers."""
    args = sys.argv[1:]
    code = main(args)
    if args and args[0] in SUBCOMMANDS:
        raise SystemExit(code)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):  # a closed pipe: nothing more can be said
        pass
    os._exit(code)
