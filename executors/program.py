"""The training program of a plan: what every rank runs, and ``plan compile`` writing it out.

:func:`run_plan` is one rank's training loop on an initialised process group: rebuild and check
the model (:func:`executors.session.load_workload`), build the executor the plan needs
(:func:`executors.runner.make_runner`), then for each step run forward and backward, optionally
compare loss and every gradient with a single-process run (:mod:`executors.parity`), and take the
optimizer step. :func:`main` wraps it for a rank started by torchrun: it joins the process group,
prints one line per step on rank 0, and turns any error into one line on stderr naming the rank
and a non-zero exit (torchrun then stops the other ranks).

:func:`write_program` writes ``DIR/train.py`` and ``DIR/plan.json``; ``plan run`` runs the same
file with torchrun, so the compiled program and ``plan run`` are one code path.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from cost_models.atomic_file import write_text_atomic
from executors.parity import ParityResult, Reference, compare, gather_gradients
from executors.runner import Runner, make_runner
from executors.session import BACKENDS, device_of, init_distributed, load_workload
from planner.errors import AutoplanError
from planner.plan import Plan, load_plan, save_plan

OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    steps: int = 3
    check_parity: bool = False
    backend: str = "gloo"
    optimizer: str = "sgd"
    lr: float = 0.01
    seed: int = 0
    timeout_s: float = 60.0

    def make_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=self.lr)
        return torch.optim.SGD(params, lr=self.lr)


@dataclass(frozen=True, kw_only=True)
class StepResult:
    step: int
    loss: float
    step_time_s: float
    parity: ParityResult | None = None


def check_options(options: RunOptions) -> None:
    if options.steps < 1:
        raise AutoplanError(f"--steps must be at least 1, got {options.steps}")
    if options.optimizer not in OPTIMIZERS:
        raise AutoplanError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {options.optimizer!r}")
    if options.lr <= 0:
        raise AutoplanError(f"--lr must be positive, got {options.lr:g}")
    if options.backend not in BACKENDS:
        raise AutoplanError(f"--backend must be one of {', '.join(BACKENDS)}, got {options.backend!r}")


def run_plan(
    plan: Plan, options: RunOptions, *, report: Callable[[StepResult], None] | None = None
) -> list[StepResult]:
    """Train ``options.steps`` steps of ``plan`` on this rank (the process group must be up)."""
    world = dist.get_world_size()
    if world != plan.cluster.num_devices:
        raise AutoplanError(
            f"the plan is for {plan.cluster.num_devices} devices but {world} processes were started: "
            f"use --nproc-per-node/--nnodes that multiply to {plan.cluster.num_devices}"
        )
    device = device_of(options.backend)
    workload = load_workload(plan, seed=options.seed, device=device, dropout=not options.check_parity)
    model, inputs = workload.build()
    runner = make_runner(plan, workload, model)
    params = list(dict.fromkeys(runner.parameters()))
    optimizer = options.make_optimizer(params) if params else None  # a rank may hold no parameters
    reference = None
    if options.check_parity and dist.get_rank() == 0:
        ref_model, ref_batch = workload.build()
        reference = Reference(ref_model, workload.model_inputs(ref_batch), loss_data=workload.loss_data(ref_batch),
                              loss_fn=workload.loss_fn, make_optimizer=options.make_optimizer,
                              batch_size=plan.batch_size, dropout=workload.dropout,
                              chunks=plan.batch_size // plan.batch_stat_rows if plan.batch_stat_rows else 1)  # fmt: skip
    results = []
    for step in range(options.steps):
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        _barrier(options.backend)
        started = time.perf_counter()
        loss = runner.step(inputs)
        forward_backward_s = time.perf_counter() - started
        parity = _check(runner, reference, loss) if options.check_parity else None
        started = time.perf_counter()
        if optimizer is not None:
            optimizer.step()
        if reference is not None:
            reference.update()
        result = StepResult(step=step, loss=loss, step_time_s=forward_backward_s + time.perf_counter() - started,
                            parity=parity)  # fmt: skip
        results.append(result)
        if report is not None:
            report(result)
    return results


def _barrier(backend: str) -> None:
    if backend == "nccl":
        torch.cuda.synchronize()
    dist.barrier()


def _check(runner: Runner, reference: Reference | None, loss: float) -> ParityResult | None:
    grads = gather_gradients(runner.gradients())
    verdict: list[ParityResult | None] = [None]
    if reference is not None:
        assert grads is not None
        reference_loss, reference_grads = reference.step()
        verdict[0] = compare(loss, reference_loss, grads, reference_grads)
    dist.broadcast_object_list(verdict, src=0)
    return verdict[0]


def parse_args(argv: Sequence[str] | None, *, plan_default: Path | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train a model with an autoplan plan (one process per device).")
    parser.add_argument("--plan", type=Path, default=plan_default, help="plan JSON (default: plan.json beside this)")
    parser.add_argument("--steps", type=int, default=RunOptions.steps, help="optimizer steps (default %(default)s)")
    parser.add_argument("--check-parity", action="store_true", help="compare loss and gradients with one process")
    parser.add_argument("--backend", default="gloo", choices=BACKENDS, help="gloo on CPU, nccl on GPUs")
    parser.add_argument("--optimizer", default=RunOptions.optimizer, choices=OPTIMIZERS)
    parser.add_argument("--lr", type=float, default=RunOptions.lr, help="learning rate (default %(default)s)")
    parser.add_argument("--seed", type=int, default=RunOptions.seed, help="seed of weights and batch")
    parser.add_argument("--timeout-s", type=float, default=RunOptions.timeout_s,
                        help="seconds a collective may wait before the run fails (default %(default)s)")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, *, plan_default: Path | None = None) -> int:
    """One rank of ``plan run`` / a compiled ``train.py``: returns the exit code."""
    args = parse_args(argv, plan_default=plan_default)
    rank = "?"
    try:
        options = RunOptions(steps=args.steps, check_parity=args.check_parity, backend=args.backend,
                             optimizer=args.optimizer, lr=args.lr, seed=args.seed, timeout_s=args.timeout_s)  # fmt: skip
        check_options(options)
        plan = load_plan(args.plan)
        rank_number, _ = init_distributed(backend=options.backend, timeout_s=options.timeout_s)
        rank = str(rank_number)
        results = run_plan(plan, options, report=_printer(plan, options) if rank_number == 0 else None)
        failed = any(r.parity is not None and not r.parity.ok for r in results)
        dist.destroy_process_group()
        return 1 if failed else 0
    except AutoplanError as error:
        print(f"rank {rank}: {error}", file=sys.stderr, flush=True)
        _exit_now(2)
    except Exception as error:  # the failing rank names itself; torchrun stops the others
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        print(f"rank {rank} failed: {type(error).__name__}: {first}", file=sys.stderr, flush=True)
        if os.environ.get("AUTOPLAN_DEBUG"):  # the whole traceback, for a bug report
            traceback.print_exc()
        _exit_now(1)
    return 1  # not reached


def _exit_now(code: int) -> None:
    """Leave at once: a failed rank must not wait at interpreter exit for its process group's threads
    (peers blocked in a collective with it), or the run would hang until the collective timeout."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _printer(plan: Plan, options: RunOptions) -> Callable[[StepResult], None]:
    if options.check_parity:
        print("parity check against one process: dropout off and random draws fixed on both sides "
              "(random streams differ by design)", flush=True)  # fmt: skip
    print(f"{plan.method} plan: {len(plan.stages)} stage(s), {plan.num_devices} device(s), batch {plan.batch_size}, "
          f"{plan.num_microbatches} microbatch(es), schedule {plan.schedule}; "
          f"estimated step {plan.estimate.step_time_s * 1e3:.3f} ms on {plan.cluster.name}", flush=True)  # fmt: skip

    def report(result: StepResult) -> None:
        line = f"step {result.step + 1}  loss {result.loss:.6f}  time {result.step_time_s * 1e3:.1f} ms"
        if result.parity is not None:
            line += f"  {result.parity.describe()}"
        print(line, flush=True)

    return report


_TEMPLATE = '''"""Training program for the {method} plan of {model} ({devices} devices).

Generated by `plan compile`. Launch one process per device:

    torchrun --nproc-per-node {devices} {here}/train.py [--steps N] [--check-parity]

or across machines with torchrun's rendezvous (same command on every node):

    torchrun --nnodes NODES --nproc-per-node PER_NODE --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 --rdzv-id JOB {here}/train.py --backend nccl

What each rank does (executors.program.run_plan):
  1. join the process group (executors.session.init_distributed), with a timeout on collectives;
  2. rebuild the model from {model} with a fixed seed and check the plan's fingerprint;
  3. build its part of the plan: {kind};
  4. per step: forward and backward over {microbatches} microbatch(es), gradient sync, optimizer step.
"""

import sys
from pathlib import Path

from executors.program import main

if __name__ == "__main__":
    sys.exit(main(plan_default=Path(__file__).resolve().parent / "plan.json"))
'''


def describe_executor(plan: Plan) -> str:
    from executors.runner import is_pure_data_parallel

    if plan.schedule == "dataflow":
        return "operators placed on devices, activations and gradients sent point to point (executors.placement)"
    if len(plan.stages) > 1:
        return (f"{len(plan.stages)} pipeline stages under torch.distributed.pipelining "
                f"({plan.schedule}), DTensor inside each stage (executors.pipeline)")  # fmt: skip
    if is_pure_data_parallel(plan) and plan.num_devices > 1:
        return "data parallel with " + ("FSDP" if plan.zero else "DDP") + " (executors.data_parallel)"
    return f"tensor parallel with DTensor on mesh {list(plan.stages[0].mesh_shape)} (executors.tensor_parallel)"


def write_program(plan: Plan, out_dir: Path) -> Path:
    """Write ``out_dir/train.py`` and ``out_dir/plan.json``; returns the program's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if plan.model.file is None:
        raise AutoplanError("the plan has no model file: plan it with the `plan` command to compile it")
    plan_with_path = plan
    model_path = Path(plan.model.file)
    if not model_path.is_absolute():
        from dataclasses import replace

        plan_with_path = replace(plan, model=replace(plan.model, file=str(model_path.resolve())))
    save_plan(plan_with_path, out_dir / "plan.json")
    text = _TEMPLATE.format(method=plan.method, model=plan_with_path.model.file, devices=plan.cluster.num_devices,
                            here=out_dir, kind=describe_executor(plan), microbatches=plan.num_microbatches)  # fmt: skip
    program = out_dir / "train.py"
    write_text_atomic(program, text, what="training program")
    return program
