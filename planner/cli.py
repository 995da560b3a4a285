"""The ``plan`` command.

``plan MODEL_FILE --cluster NAME|FILE --batch-size B ...`` plans a model; subcommands
``profile``, ``calibrate``, ``compare``, ``run``, ``compile`` and ``show`` stand beside it.
Every user error is one line on stderr and exit code 2; no output file is written unless the
whole command succeeded.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from planner.errors import AutoplanError
from planner.plan import Plan

SUBCOMMANDS = ("profile", "calibrate", "compare", "run", "compile", "show")
EXIT_USAGE = 2


class UsageParser(argparse.ArgumentParser):
    """Usage errors as one line (``plan: error: ... (see plan --help)``), exit code 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(EXIT_USAGE)


_DESCRIPTION = """\
Find how to train a PyTorch model on a cluster: pipeline stages, per-operator sharding and
data parallelism, with an estimate of step time and memory per device.

  plan MODEL_FILE --cluster NAME|FILE --batch-size B [options]   plan a model (this form)
  plan profile MODEL_FILE --batch-size B [options]               per-node FLOPs, time, memory
  plan calibrate [--out FILE]                                    measure this machine
  plan compare MODEL_FILE --cluster NAME|FILE --batch-size B     every method, judged by one simulator
  plan run PLAN.json [--steps N] [--check-parity]                 train with the plan on this machine
  plan compile PLAN.json --out DIR                                write DIR/train.py for torchrun
  plan show PLAN.json [--figure OUT.png] [--json]                 summary, simulated step, figure

A model file defines build_model(**kwargs) -> nn.Module and example_inputs(batch_size) -> tuple
of tensors (optionally loss_fn(output, inputs)); see examples/. Clusters: local-cpu,
p3.16xlarge, dgx-a100, dgx-h100, or a .toml/.json file (`plan calibrate` writes one).
Run `plan SUBCOMMAND --help` for a subcommand's options."""


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_file", metavar="MODEL_FILE", help="Python file with build_model and example_inputs")
    parser.add_argument("--batch-size", type=int, required=True, metavar="B", help="global batch size of one step")
    parser.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument for build_model (repeatable), e.g. --model-arg size=1.3b",
    )
    parser.add_argument(
        "--tracer", choices=("export", "fx"), default="export", help="graph capture: torch.export (default) or torch.fx"
    )


def add_cluster_options(parser: argparse.ArgumentParser, *, required: bool) -> None:
    parser.add_argument(
        "--cluster",
        required=required,
        default=None if required else "local-cpu",
        metavar="NAME|FILE",
        help="preset (local-cpu, p3.16xlarge, dgx-a100, dgx-h100) or a cluster .toml/.json file",
    )
    parser.add_argument("--nodes", type=int, metavar="N", help="number of nodes (overrides the cluster's)")
    parser.add_argument("--devices-per-node", type=int, metavar="M", help="devices per node (overrides the cluster's)")


def add_search_options(parser: argparse.ArgumentParser) -> None:
    """Options every method reads: costs, memory, pipeline search, Megatron degrees, RL budget."""
    from planner.api import COST_MODELS

    parser.add_argument(
        "--optimizer", default=None, help="adam-mixed (16 B/param, default on GPUs), adam-fp32 (default on CPU), sgd"
    )
    parser.add_argument(
        "--cost-model",
        choices=COST_MODELS,
        default="roofline",
        help="roofline (analytical, any device) or profiled (times measured on this machine's CPU)",
    )
    parser.add_argument(
        "--memory-fraction", type=float, default=1.0, metavar="F", help="share of device memory the plan may use"
    )
    parser.add_argument(
        "--max-stages", type=int, default=None, metavar="K", help="most pipeline stages (default: no limit)"
    )
    parser.add_argument(
        "--microbatches",
        type=_microbatches,
        default=None,
        metavar="K|auto",
        help="microbatches per step: a divisor of the batch, or auto (default: search the powers of two up to 64)",
    )
    parser.add_argument(
        "--schedule",
        choices=("auto", "1f1b", "gpipe"),
        default="auto",
        help="pipeline schedule; auto takes 1f1b (same time, never more memory)",
    )
    parser.add_argument(
        "--remat",
        choices=("auto", "on", "off"),
        default="auto",
        help="activation recomputation per stage: auto lets the search choose",
    )
    parser.add_argument("--zero", action="store_true", help="shard optimizer state and gradients over data axes (ZeRO)")
    parser.add_argument(
        "--ilp-time-limit", type=float, default=30.0, metavar="S", help="seconds per ILP solve (default 30)"
    )
    parser.add_argument(
        "--degrees",
        type=_degrees,
        default=None,
        metavar="T,P,D",
        help="megatron: evaluate this one (tensor, pipeline, data) configuration instead of the grid",
    )
    parser.add_argument(
        "--rl-budget-s", type=float, default=30.0, metavar="S", help="rl: seconds of training (default 30)"
    )
    parser.add_argument("--seed", type=int, default=0, help="rl: random seed (default 0)")


def search_kwargs(options: argparse.Namespace) -> dict:
    """The keyword options of :func:`planner.api.prepare` from parsed search options."""
    return {
        "tracer": options.tracer,
        "optimizer": options.optimizer,
        "cost_model": options.cost_model,
        "memory_fraction": options.memory_fraction,
        "max_stages": options.max_stages,
        "microbatches": options.microbatches,
        "schedule": options.schedule,
        "remat": options.remat,
        "zero": options.zero,
        "ilp_time_limit_s": options.ilp_time_limit,
        "degrees": options.degrees,
        "rl_budget_s": options.rl_budget_s,
        "seed": options.seed,
    }


def _degrees(text: str) -> tuple[int, int, int]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be three positive integers T,P,D (e.g. 2,4,2), got {text!r}")
    return values  # type: ignore[return-value]


def _plan_parser() -> argparse.ArgumentParser:
    from planner.api import METHODS

    parser = UsageParser(
        prog="plan",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_options(parser)
    add_cluster_options(parser, required=True)
    methods = "; ".join(f"{name}: {text}" for name, text in METHODS.items())
    parser.add_argument("--method", default="auto", choices=tuple(METHODS), metavar="M", help=methods)
    add_search_options(parser)
    parser.add_argument("--explain", action="store_true", help="print each node's split, spec and seconds")
    parser.add_argument(
        "--out", default="plan.json", metavar="FILE", help="where to write the plan (default plan.json)"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of a summary")
    return parser


def _microbatches(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer or auto, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or auto, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``plan`` console script; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    warnings.showwarning = _one_line_warning
    try:
        if args and args[0] in SUBCOMMANDS:
            return _run_subcommand(args[0], args[1:])
        return _run_plan(_plan_parser().parse_args(args))
    except AutoplanError as error:
        sys.stderr.write(f"plan: error: {error}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write("plan: interrupted\n")
        return 130


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(f"plan: warning: {str(message).splitlines()[0]}\n")


def _run_subcommand(name: str, args: list[str]) -> int:
    if name == "profile":
        from planner.cli_profile import run_profile

        return run_profile(args)
    if name == "compare":
        from planner.cli_compare import run_compare

        return run_compare(args)
    if name in ("run", "compile"):
        from planner.cli_run import run_compile, run_run

        return run_run(args) if name == "run" else run_compile(args)
    if name == "show":
        from planner.cli_show import run_show

        return run_show(args)
    from planner.cli_calibrate import run_calibrate

    return run_calibrate(args)


def _run_plan(options: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    from cost_models.cluster import load_cluster
    from planner.api import plan_model_file
    from planner.model_file import parse_model_args
    from planner.plan import save_plan
    from planner.report import plan_summary

    cluster = load_cluster(options.cluster, num_nodes=options.nodes, devices_per_node=options.devices_per_node)
    model_args = parse_model_args(options.model_arg)
    columns = (TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn())
    console = Console(stderr=True)
    bar = Progress(*columns, console=console, transient=True, disable=not console.is_terminal)
    task = bar.add_task(f"capturing {options.model_file} for {cluster.num_devices} devices", total=None)

    def progress(what: str, done: int, total: int) -> None:
        bar.update(task, description=what, completed=done, total=total)

    with bar:
        result = plan_model_file(
            options.model_file,
            cluster,
            batch_size=options.batch_size,
            model_args=model_args,
            method=options.method,
            progress=progress,
            **search_kwargs(options),
        )
    out = Path(options.out)
    save_plan(result, out)
    if options.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(plan_summary(result))
        print(f"wrote {out}")
    if options.explain:
        _print_explanation(result)
    return 0


def _print_explanation(result: Plan) -> None:
    from rich.console import Console

    from planner.explain import ExplainRow, explain_table

    console = Console(width=200, stderr=False)
    for stage in result.stages:
        if not stage.explanation:
            console.print(f"stage {stage.index}: {result.method} has no per-node explanation")
            continue
        rows = [ExplainRow(**row) for row in stage.explanation]
        mesh = "×".join(str(size) for size in stage.mesh_shape)
        console.print(explain_table(rows, title=f"stage {stage.index} on mesh {mesh}: split per mesh axis"))


def entry() -> NoReturn:
    raise SystemExit(main())
