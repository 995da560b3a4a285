"""What every ``plan`` subcommand shares: the one-line usage errors, the model, cluster and search
options and the cluster and prepared model they name (:func:`model_cluster`, :func:`prepare_from_options`), the
plan-file commands' parser (:func:`plan_file_parser`), the ``--figure`` check, and one-line warnings.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from planner.errors import AutoplanError

if TYPE_CHECKING:
    from cost_models.cluster import Cluster
    from planner.inter.search import Progress
    from planner.options import PlanOptions
    from planner.preparation import Prepared

EXIT_USAGE = 2
EXIT_INTERNAL = 3  # a bug of ours (InternalError)


class UsageParser(argparse.ArgumentParser):
    """Usage errors as one line (``plan: error: ... (see plan --help)``), exit code 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(EXIT_USAGE)


def plan_file_parser(*, prog: str, description: str, program_dir: bool = False) -> UsageParser:
    """The parser of a command that reads a plan file (``run``, ``compile``, ``show``): its ``PLAN.json``
    (``program_dir``: or a directory ``plan compile`` wrote)."""
    parser = UsageParser(prog=prog, description=description)
    if program_dir:
        help_text = "a plan written by `plan ... --out PLAN.json`, or a directory `plan compile --out DIR` wrote"
        parser.add_argument("plan", metavar="PLAN.json|DIR", help=help_text)
    else:
        parser.add_argument("plan", metavar="PLAN.json", help="a plan written by `plan ... --out PLAN.json`")
    return parser


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
        help="preset (local-cpu, p3.16xlarge, dgx-2h, dgx-a100, dgx-h100) or a cluster .toml/.json file",
    )
    parser.add_argument("--nodes", type=int, metavar="N", help="number of nodes (overrides the cluster's)")
    parser.add_argument("--devices-per-node", type=int, metavar="M", help="devices per node (overrides the cluster's)")
    parser.add_argument(
        "--no-calibrate",
        action="store_true",
        help="plan local-cpu with the preset's rough figures instead of this machine's calibration (by default "
        "measured once by `plan calibrate --quick` and cached per machine and process count)",
    )


def add_search_options(parser: argparse.ArgumentParser) -> None:
    """Options every method reads: costs, memory, pipeline search, Megatron degrees, RL budget
    (:class:`planner.options.PlanOptions`, built by :func:`plan_options`)."""
    _add_cost_options(parser)
    _add_pipeline_options(parser)
    _add_sync_options(parser)
    _add_search_limits(parser)


def _add_cost_options(parser: argparse.ArgumentParser) -> None:
    """What a step costs: optimizer, compute times, memory budget, the runtime the estimate describes."""
    from planner.costing.runtime_profiles import OUR_RUNTIME, PROFILES
    from planner.costing.setup import COST_MODELS

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
        "--memory-fraction",
        type=float,
        default=1.0,
        metavar="F",
        help="share of the usable device memory the plan may use: capacity less a reserve for the CUDA context, "
        "NCCL buffers and allocator fragmentation (GPUs) or the interpreter (cpu); default 1",
    )
    parser.add_argument(
        "--runtime",
        choices=tuple(PROFILES),
        default=OUR_RUNTIME,
        help="the system the estimate describes: autoplan (default), our executors, what plan run executes; or a "
        "published system's runtime, to estimate its runs as they ran: megatron-lm-2019, megatron-lm-2021 (local "
        "DDP: gradients all-reduced in one buffer after the backward; its fp16 optimizer), megatron-lm-2021-torch-ddp "
        "(torch DDP's overlapped buckets). A plan made under another runtime says so and plan run refuses it",
    )


def _add_pipeline_options(parser: argparse.ArgumentParser) -> None:
    """What the pipeline search may choose: stages, microbatches, schedule, recomputation, ZeRO, search space."""
    from planner.options import OffloadChoice, RematChoice, ScheduleChoice, SearchSpace, ZeroChoice

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
        choices=_values(ScheduleChoice),
        default="auto",
        help="pipeline schedule: auto prices 1f1b (never more memory than gpipe) and, for each method's pipeline, "
        "interleaved 1F1B (v = 2 or 4 virtual stages per rank) and zero bubble (v = 1 or 2: each backward split "
        "into input and weight gradients), and keeps the fastest that fits; a named schedule forces a pipeline "
        "that uses it (torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, "
        "ScheduleInterleavedZeroBubble)",
    )
    parser.add_argument(
        "--remat",
        choices=_values(RematChoice),
        default="auto",
        help="activation recomputation per stage: attention recomputes each attention core (selective, Korthikanti "
        "et al.), full each layer (on: full); auto (default) lets the search choose per stage; off-or-full lets it "
        "choose between off and full only (Alpa's choice)",
    )
    parser.add_argument(
        "--space",
        choices=_values(SearchSpace),
        default="full",
        help="what auto searches: full (default) every choice; alpa only Alpa's search space, to measure what the "
        "rest adds: GPipe or 1F1B, each stage recomputing all its layers or none, no ZeRO, no sequence "
        "parallelism, exact gradient sync (the baselines keep their own features)",
    )
    parser.add_argument(
        "--zero",
        nargs="?",
        const="2",
        choices=_values(ZeroChoice),
        default="auto",
        help="ZeRO over the data-parallel axes: 1 shards optimizer state, 2 gradients too, 3 parameters too (2 and 3 "
        "run under FSDP, on data-parallel plans; sharded and pipeline stages run 1 at most: Megatron's distributed "
        "optimizer); auto (default) lets the search choose per stage; --zero alone is 2",
    )
    parser.add_argument(
        "--offload",
        choices=_values(OffloadChoice),
        default="auto",
        help="CPU offload under FSDP (torch's CPUOffloadPolicy): the parameter, gradient and optimizer-state shards "
        "in host memory, the optimizer stepping on the CPU, priced over PCIe; auto (default) only when no plan fits "
        "without it; on: the data-parallel plan with it; off: never",
    )


def _add_sync_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-lossy",
        action="store_true",
        help="let auto also price lossy gradient syncs and keep the fastest: bf16 compression, PowerSGD of rank 4 "
        "(with error feedback), for data-parallel plans across nodes local SGD averaging every 4 or 16 steps, "
        "TernGrad, QSGD of 16 levels and signSGD (the choices tests/test_lossy_sync.py trains near the exact loss "
        "curve), and synchronous parameter servers with 2 to 64 shards (exact sync's update); the plan says "
        "what it changed and what it saved (never chosen without this flag)",
    )
    parser.add_argument(
        "--grad-sync",
        default=None,
        metavar="FORM",
        help="force this gradient sync on every candidate: exact, bf16, powersgd:R, local-sgd:H (torch's DDP "
        "hooks), topk:RATIO, onebit, threshold:TAU, terngrad, qsgd:S, signsgd, dgc:RATIO (sgd-momentum only) "
        "(all-gathered compressed gradients, executors/compressed_sync.py), dga:D (delayed averaging, "
        "data-parallel only), ps:S or ps:S:K (S parameter-server shards, applied K steps late; data-parallel "
        "only); one that changes the update (all but exact and ps:S) needs --allow-lossy (README: what each "
        "trades)",
    )


def _add_search_limits(parser: argparse.ArgumentParser) -> None:
    """Solver time, Megatron's degrees, the RL budget and seed, processes."""
    parser.add_argument(
        "--ilp-time-limit",
        dest="ilp_time_limit_s",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds per ILP solve (default 30)",
    )
    parser.add_argument(
        "--degrees",
        type=_degrees,
        default=None,
        metavar="T,P,D",
        help="megatron: evaluate this one (tensor, pipeline, data) configuration instead of the grid",
    )
    parser.add_argument(
        "--rl-budget-s",
        type=float,
        default=30.0,
        metavar="S",
        help="rl: seconds of training (default 30; a run stopped by the clock depends on the machine's speed)",
    )
    parser.add_argument(
        "--rl-iterations",
        type=int,
        default=None,
        metavar="N",
        help="rl: stop after N policy updates, without a time budget: the same --seed then gives the same placement "
        "on any machine",
    )
    parser.add_argument("--seed", type=int, default=0, help="rl: random seed (default 0)")
    parser.add_argument(
        "--jobs",
        type=int,
        default=available_cores(),
        metavar="N",
        help="processes for independent work: with 2 or more the model's two exports, the layer tables and the "
        f"microbatch counts' stage DPs run at the same time; the plan is the same for any N (default: the cores "
        f"this process may use, {available_cores()} here; --jobs 1 runs them in turn)",
    )


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _values(choices: type[enum.StrEnum]) -> tuple[str, ...]:
    """The command-line strings of an option's choices (plain strings: argparse's messages print them)."""
    return tuple(choice.value for choice in choices)


def plan_options(options: argparse.Namespace, *, method: str = "auto") -> PlanOptions:
    """The one options value of the parsed search options (checked as it is built: AutoplanError, exit 2): every
    :class:`planner.options.PlanOptions` field but ``method`` is the option of its name."""
    from planner.options import PlanOptions

    searched = {field.name: getattr(options, field.name) for field in fields(PlanOptions) if field.name != "method"}
    return PlanOptions(method=method, **searched)


def model_cluster(options: argparse.Namespace) -> Cluster:
    """The cluster of ``--cluster``, ``--nodes``, ``--devices-per-node``, calibrated where it is this machine
    (:func:`calibration.machine.planning_cluster`; the calibration run says so on stderr), once the model file of
    the model options loads: a missing or broken model file says so before any calibration."""
    from calibration.machine import planning_cluster
    from planner.ir.model_file import load_model_file

    def say(message: str) -> None:
        sys.stderr.write(f"plan: {message}\n")
        sys.stderr.flush()

    load_model_file(options.model_file)
    return planning_cluster(
        options.cluster,
        num_nodes=options.nodes,
        devices_per_node=options.devices_per_node,
        calibrate=not options.no_calibrate,
        say=say,
    )


def prepare_from_options(
    options: argparse.Namespace, *, cluster: Cluster, chosen: PlanOptions, progress: Progress | None = None
) -> Prepared:
    """The model of the model options captured and priced on ``cluster`` under ``chosen``
    (:func:`planner.api.prepare_model_file`)."""
    from planner.api import prepare_model_file
    from planner.ir.model_file import parse_model_args

    return prepare_model_file(
        options.model_file,
        cluster,
        batch_size=options.batch_size,
        options=chosen,
        model_args=parse_model_args(options.model_arg),
        progress=progress,
    )


def figure_path(text: str | None) -> Path | None:
    """The ``--figure`` PNG to write (None: none asked for), checked before any work."""
    if text is None:
        return None
    figure = Path(text)
    if figure.suffix.lower() != ".png":
        raise AutoplanError(f"--figure must name a .png file, got {figure}")
    if not figure.parent.is_dir():
        raise AutoplanError(f"--figure: directory {figure.parent} does not exist")
    if figure.is_dir():
        raise AutoplanError(f"--figure {figure} is a directory: name a .png file")
    return figure


def _degrees(text: str) -> tuple[int, int, int]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be three positive integers T,P,D (e.g. 2,4,2), got {text!r}")
    return values  # type: ignore[return-value]


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


@contextlib.contextmanager
def one_line_warnings() -> Iterator[None]:
    """Inside, each warning prints once as one ``plan: warning: ...`` line; the previous handler is back after."""
    shown: set[str] = set()

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        text = str(message).splitlines()[0]
        if text not in shown:
            shown.add(text)
            sys.stderr.write(f"plan: warning: {text}\n")

    with warnings.catch_warnings():  # restores warnings.showwarning and the filters on exit
        warnings.showwarning = show
        yield
