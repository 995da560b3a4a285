"""The training program of a plan: ``plan compile`` writing it, and the same loop in-process for tests.

:func:`write_program` writes ``DIR/train.py`` (the text is :data:`executors.training.program_template.TEMPLATE`:
a page of plain code that imports :mod:`executors.training.runtime` for the parallel parts) beside
``DIR/plan.json``; ``plan run`` launches the same file with torchrun.

:func:`run_plan` is the program's loop without checkpoints or data loader, for callers that already
have a process group and run many plans in one job (the parity tests, benchmarks): synthetic batches,
the optimizer given (default: the plan's), optional clipping, ``--check-parity`` against one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from string import Template
from typing import Any

import torch
import torch.distributed as dist

from executors.parity import ParityResult
from executors.precision import Precision, describe_optimizer, make_optimizer
from executors.training.parallel_model import parallelize
from executors.training.parity_check import ParityCheck
from executors.training.program_template import TEMPLATE
from planner.atomic_file import write_text_atomic
from planner.errors import AutoplanError
from planner.ir.model_file import build_kwargs, load_model_file
from planner.plan import Plan, save_plan
from planner.plan.launch import multi_node_note, torchrun_command


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    steps: int = 3
    check_parity: bool = False
    optimizer: str | None = None  # None: the plan's
    lr: float = 0.01
    seed: int = 0
    max_grad_norm: float | None = None  # None: no clipping

    def optimizer_for(self, plan: Plan) -> str:
        return self.optimizer or plan.optimizer


@dataclass(frozen=True, kw_only=True)
class StepResult:
    step: int
    loss: float
    step_time_s: float
    parity: ParityResult | None = None


def run_plan(
    plan: Plan, options: RunOptions, *, report: Callable[[StepResult], None] | None = None
) -> list[StepResult]:
    """Train ``options.steps`` steps of ``plan`` on this rank (the process group must be up)."""
    world = dist.get_world_size()
    if world != plan.cluster.num_devices:
        raise AutoplanError(f"the plan is for {plan.cluster.num_devices} devices but {world} processes were started")
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    name = options.optimizer_for(plan)
    model = parallelize(
        plan,
        device=device,
        seed=options.seed,
        precision=Precision.for_optimizer(name),
        dropout=not options.check_parity,
    )
    optimizer = make_optimizer(name, model.parameters(), lr=options.lr) if model.parameters() else None
    parity = None
    if options.check_parity:
        parity = ParityCheck(
            model,
            make_optimizer=lambda params: make_optimizer(name, params, lr=options.lr),
            max_grad_norm=options.max_grad_norm,
        )
    info = model.rank_info()
    batches = model.synthetic_batches(info) if info.needs_data else None
    results = []
    for step in range(options.steps):
        batch = next(batches) if batches is not None else None
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        _barrier(device)
        started = time.perf_counter()
        loss = model.train_step(batch)
        norm = model.clip_grad_norm_(options.max_grad_norm) if options.max_grad_norm else None
        verdict = (
            parity.check(batch, loss=loss, grad_norm=norm if norm is not None else model.grad_norm())
            if parity
            else None
        )
        if optimizer is not None:
            optimizer.step()
            model.after_optimizer_step()
        result = StepResult(step=step, loss=loss, step_time_s=time.perf_counter() - started, parity=verdict)
        results.append(result)
        if report is not None:
            report(result)
    return results


def _barrier(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    dist.barrier()


def write_program(plan: Plan, out_dir: Path) -> Path:
    """Write ``out_dir/train.py`` and ``out_dir/plan.json``; returns the program's path."""
    if plan.model.file is None:
        raise AutoplanError("the plan has no model file: plan it with the `plan` command to compile it")
    model_path = Path(plan.model.file).resolve()
    plan_with_path = replace(plan, model=replace(plan.model, file=str(model_path)))
    model_file = load_model_file(model_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_plan(plan_with_path, out_dir / "plan.json")
    program = out_dir / "train.py"
    write_text_atomic(
        program, program_text(plan_with_path, model_file=model_file, program=program), what="training program"
    )
    return program


def program_text(plan: Plan, *, model_file: Any, program: Path) -> str:
    """The ``train.py`` of ``plan`` (its model file already loaded)."""
    from planner.plan.shape import plan_shape

    note = multi_node_note(plan.cluster)
    has_loss = model_file.loss_fn is not None
    return Template(TEMPLATE).substitute(
        method=plan.method,
        model_name=Path(str(plan.model.file)).name,
        shape=plan_shape(plan),
        devices=plan.cluster.num_devices,
        launch=torchrun_command(plan.cluster, str(program), args="--steps 100"),
        launch_note=f"\n({note})\n" if note else "",
        model_file=plan.model.file,
        model_args=repr(build_kwargs(model_file, dict(plan.model.args))),
        optimizer=plan.optimizer,
        optimizer_text=describe_optimizer(plan.optimizer),
        loss_call="MODEL_FILE.loss_fn(output, targets)"
        if has_loss
        else "runtime.default_loss(output, targets)  # the model file has no loss_fn: the mean of the output",
        loss_data="`targets` are the batch's targets"
        if model_file.has_targets
        else "`targets` are the batch's inputs (the model file has no example_targets)",
    )
