"""``plan run PLAN.json`` and ``plan compile PLAN.json --out DIR``: execute a plan, or write its program.

The executing lives in :mod:`executors` (launch, program); this module parses the command line
and, before anything starts, refuses a plan whose stored strategies no sharding rule produces
(:func:`planner.costing.stage_work.check_plan_strategies`, on the graph the launcher's preflight
captured: a hand-edited plan is refused, not guessed at). ``run`` starts one process per device of
the plan on this machine with torch.distributed's launcher — a compiled directory's own program, edits
included, or the stock one for a bare plan file — and prints loss and step time per step;
``compile`` writes the program's directory (:func:`executors.training.program.write_program`: ``train.py``,
``plan.json``, the model file copied into ``model/``, ``launch.sh``, ``train.sbatch``, ``compiled.json``,
``README.md``) for ``torchrun`` on one machine or many.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path


def _run_parser() -> argparse.ArgumentParser:
    from planner.cli.options import plan_file_parser

    parser = plan_file_parser(
        prog="plan run",
        program_dir=True,
        description=(
            "Train the plan's model for a few steps on this machine. Given a directory `plan compile` wrote (or its "
            "plan.json), it runs that directory's train.py, your edits included; given any other plan file, the stock "
            "program (train.py written into a temporary directory); it says which before it starts. torchrun starts "
            "one process per device of the plan "
            "(gloo and CPU processes for a CPU plan, nccl and one GPU each for a GPU plan; a GPU plan needs that many "
            "GPUs here and one node). The model file named in the plan is rebuilt with a fixed seed and checked "
            "against the plan's fingerprint. Prints loss, step time, throughput and MFU per step beside the plan's "
            "estimate. The run uses the plan's optimizer and precision unless --optimizer overrides them. For "
            "several machines use `plan compile` and torchrun. Options after `--` go to train.py as they are, e.g. "
            "`plan run DIR --steps 4 -- --checkpoint-dir ckpt --export-hf hf` (see `python DIR/train.py --help`)."
        ),
    )
    parser.add_argument("--steps", type=int, default=3, metavar="N", help="optimizer steps (default 3)")
    parser.add_argument(
        "--check-parity",
        action="store_true",
        help="compare loss, gradient norm and every gradient with a single-process run each step, in "
        "the run's precision; exit 1 on a mismatch (fp32: rtol 1e-4, atol 1e-5; bf16: rtol "
        "3e-2, atol 1e-3)",
    )
    parser.add_argument(
        "--backend",
        default=None,
        choices=("gloo", "nccl"),
        help="default: the plan's (nccl for GPU plans, gloo for CPU plans)",
    )
    parser.add_argument(
        "--optimizer",
        default=None,
        choices=("adam-mixed", "adam-fp32", "sgd", "sgd-momentum"),
        help="default: the plan's; another one is reported as a deviation from the estimate",
    )
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the program's, 3e-4)")
    parser.add_argument(
        "--max-grad-norm",
        type=float,
        default=None,
        metavar="X",
        help="clip the global gradient norm to X (default: the program's, 1.0; 0 turns it off)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the synthetic batches")
    parser.add_argument(
        "--measure-memory",
        action="store_true",
        help="print each device's model state + peak saved activations beside the estimate",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds a collective may wait for a peer before the run fails (default 60)",
    )
    return parser


def program_args(args: argparse.Namespace) -> list[str]:
    """``plan run``'s options as the training program's command line."""
    from planner.errors import AutoplanError

    if args.steps < 1:
        raise AutoplanError(f"--steps must be at least 1, got {args.steps}")
    if args.lr is not None and args.lr <= 0:
        raise AutoplanError(f"--lr must be positive, got {args.lr:g}")
    if args.timeout_s <= 0:
        raise AutoplanError(f"--timeout-s must be positive, got {args.timeout_s:g}")
    out = ["--steps", str(args.steps), "--seed", str(args.seed), "--timeout-s", repr(args.timeout_s)]
    for flag, value in (("--optimizer", args.optimizer), ("--lr", args.lr), ("--max-grad-norm", args.max_grad_norm)):
        if value is not None:
            out += [flag, str(value)]
    out += ["--measure-memory"] if args.measure_memory else []
    return [*out, "--check-parity"] if args.check_parity else out


def run_run(argv: Sequence[str]) -> int:
    from executors.training.launch import launch
    from executors.training.program import program_to_run
    from planner.costing.stage_work import check_plan_strategies

    ours, passed = split_passthrough(argv)
    args = _run_parser().parse_args(ours)
    _check_runtime(program_to_run(Path(args.plan)).plan_path, what="plan run")
    return launch(args.plan, [*program_args(args), *passed], backend=args.backend, check_plan=check_plan_strategies)


def split_passthrough(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``plan run``'s own options, and those after ``--`` that go to the training program unchanged."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def _check_runtime(path: str | Path, *, what: str) -> None:
    """Refuse a plan whose estimate describes another runtime than our executors (``plan --runtime``)."""
    from planner.costing.runtime_profiles import runtime_profile
    from planner.errors import AutoplanError
    from planner.plan import load_plan

    refusal = runtime_profile(load_plan(path).runtime).refusal(what=what)
    if refusal:
        raise AutoplanError(refusal)


def _compile_parser() -> argparse.ArgumentParser:
    from planner.cli.options import plan_file_parser

    parser = plan_file_parser(
        prog="plan compile",
        description=(
            "Write the plan's training program as a directory you can copy to the cluster: DIR/train.py, a page of "
            "plain Python you own and edit (model build, data loader, loss, optimizer, learning-rate schedule, "
            "gradient clipping, checkpoints, logging); DIR/plan.json; the model file and the files beside it that it "
            "imports, copied into DIR/model/; DIR/launch.sh (torchrun for the plan's nodes) and DIR/train.sbatch "
            "(Slurm), both restarting a failed job (--max-restarts, default 3) that train.py then resumes from its "
            "newest complete checkpoint; DIR/compiled.json (the autoplan version and the model files' sha256, "
            "checked when the program starts); DIR/README.md (what to install on every node, how to run, the "
            "flags). Prints the torchrun line for the plan's cluster: `torchrun --standalone --nproc-per-node M` on "
            "one node, `--nnodes N --nproc-per-node M` with a c10d rendezvous on several. `plan run DIR` runs the "
            "same program here."
        ),
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to write the program into")
    return parser


def run_compile(argv: Sequence[str]) -> int:
    from executors.training.launch import preflight
    from executors.training.program import write_program
    from executors.training.program_record import MODEL_FOLDER, read_record
    from planner.costing.stage_work import check_plan_strategies
    from planner.errors import AutoplanError
    from planner.plan import load_plan
    from planner.plan.launch import is_cpu_cluster, multi_node_note, torchrun_command

    args = _compile_parser().parse_args(list(argv))
    _check_runtime(args.plan, what="plan compile")
    plan = load_plan(args.plan)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise AutoplanError(f"--out {out} exists and is not a directory")
    check_plan_strategies(plan, preflight(plan))
    program = write_program(plan, out)
    record = read_record(out)
    models = ", ".join(name.removeprefix(f"{MODEL_FOLDER}/") for name in record.model_files) if record else ""
    print(f"wrote {program} (yours to edit: data loader, loss, optimizer, schedule) and {out / 'plan.json'}")
    print(f"      {out / MODEL_FOLDER}/ ({models}), launch.sh, train.sbatch, compiled.json, README.md")
    if is_cpu_cluster(plan.cluster):
        print(f"try it here: plan run {out} --steps 10 --check-parity   (runs {program}, your edits included)")
    print(f"launch: {torchrun_command(plan.cluster, str(program), args='--steps 100')}")
    note = multi_node_note(plan.cluster)
    if note:
        print(f"        ({note})")
    print(
        f"    or: {out / 'launch.sh'} -- --steps 100   (torchrun restarting a failed job; Slurm: sbatch train.sbatch)"
    )
    return 0
