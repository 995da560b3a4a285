"""``plan run PLAN.json`` and ``plan compile PLAN.json --out DIR``: execute a plan, or write its program.

The executing lives in :mod:`executors` (launch, program); this module parses the command line
and, before anything starts, refuses a plan whose stored strategies no sharding rule produces
(:func:`planner.costing.stage_work.check_plan_strategies`, on the graph the launcher's preflight
captured: a hand-edited plan is refused, not guessed at). ``run`` starts one process per device of
the plan on this machine with torch.distributed's launcher and prints loss and step time per step;
``compile`` writes ``DIR/train.py`` and ``DIR/plan.json`` for ``torchrun`` on one machine or many.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path


def _run_parser() -> argparse.ArgumentParser:
    from executors.program import OPTIMIZERS, RunOptions
    from executors.session import BACKENDS
    from planner.cli.options import UsageParser

    parser = UsageParser(
        prog="plan run",
        description=(
            "Train the plan's model for a few steps with torch.distributed, one process per device of the plan on "
            "this machine (pipeline stages with torch.distributed.pipelining, tensor parallelism with DTensor, data "
            "parallelism with DDP/FSDP, operator placements with point-to-point sends). The model file named in the "
            "plan is rebuilt with a fixed seed and checked against the plan's fingerprint. Prints loss and step time "
            "per step. For several machines use `plan compile` and torchrun."
        ),
    )
    parser.add_argument("plan", metavar="PLAN.json", help="a plan written by `plan ... --out PLAN.json`")
    parser.add_argument("--steps", type=int, default=RunOptions.steps, metavar="N", help="optimizer steps (default 3)")
    parser.add_argument("--check-parity", action="store_true",
                        help="compare loss and every gradient with a single-process run each step; exit 1 on a "
                             "mismatch (fp32, rtol 1e-4, atol 1e-5)")  # fmt: skip
    parser.add_argument("--backend", default="gloo", choices=BACKENDS, help="gloo on CPU (default), nccl on GPUs")
    parser.add_argument("--optimizer", default=RunOptions.optimizer, choices=OPTIMIZERS, help="default sgd")
    parser.add_argument("--lr", type=float, default=RunOptions.lr, help="learning rate (default 0.01)")
    parser.add_argument("--seed", type=int, default=RunOptions.seed, help="seed of the weights and the batch")
    parser.add_argument("--timeout-s", type=float, default=RunOptions.timeout_s, metavar="S",
                        help="seconds a collective may wait for a peer before the run fails (default 60)")  # fmt: skip
    return parser


def run_run(argv: Sequence[str]) -> int:
    from executors.launch import launch
    from executors.program import RunOptions

    args = _run_parser().parse_args(list(argv))
    options = RunOptions(steps=args.steps, check_parity=args.check_parity, backend=args.backend,
                         optimizer=args.optimizer, lr=args.lr, seed=args.seed, timeout_s=args.timeout_s)  # fmt: skip
    from planner.costing.stage_work import check_plan_strategies

    return launch(args.plan, options, check_plan=check_plan_strategies)


def _compile_parser() -> argparse.ArgumentParser:
    from planner.cli.options import UsageParser

    parser = UsageParser(
        prog="plan compile",
        description=(
            "Write a self-contained training program for a plan: DIR/train.py beside a copy of the plan as "
            "DIR/plan.json. Launch it with `torchrun --nproc-per-node N DIR/train.py` (N = the plan's devices), or "
            "on several machines with torchrun's rendezvous; `plan run` runs the same program."
        ),
    )
    parser.add_argument("plan", metavar="PLAN.json", help="a plan written by `plan ... --out PLAN.json`")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to write train.py and plan.json into")
    return parser


def run_compile(argv: Sequence[str]) -> int:
    from executors.launch import preflight
    from executors.program import write_program
    from planner.costing.stage_work import check_plan_strategies
    from planner.errors import AutoplanError
    from planner.plan import load_plan

    args = _compile_parser().parse_args(list(argv))
    plan = load_plan(args.plan)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise AutoplanError(f"--out {out} exists and is not a directory")
    check_plan_strategies(plan, preflight(plan))
    program = write_program(plan, out)
    print(f"wrote {program} and {out / 'plan.json'}")
    print(f"launch with: torchrun --nproc-per-node {plan.cluster.num_devices} {program}")
    return 0
