"""The training program's loop in-process, for workers that run many plans in one torchrun job.

:func:`run_plan` is ``train.py``'s loop (:mod:`executors.training.program_template`) without checkpoints or data loader,
for callers that already have a process group (the parity and lossy-sync workers): synthetic batches, the
optimizer given (default: the plan's), optional clipping, ``--check-parity`` against one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from executors.parity import ParityResult
from executors.precision import Precision, make_optimizer
from executors.training.parallel_model import parallelize
from executors.training.parity_check import ParityCheck
from planner.errors import AutoplanError
from planner.plan import Plan


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
    made = model.parameters()
    optimizer = make_optimizer(name, made, lr=options.lr, grad_sync=plan.grad_sync) if made else None
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
