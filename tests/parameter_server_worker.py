"""Train parameter-server plans and check them against one process; rank 0 writes a JSON report.

Used by ``tests/test_parameter_server.py``: ``python -m torch.distributed.run --nproc-per-node N
tests/parameter_server_worker.py OUT.json PLAN.json...``. Each plan trains :data:`STEPS` steps of AdamW with
gradient clipping (:data:`MAX_GRAD_NORM`, small enough to clip) through the real training step
(:class:`executors.training.parallel_model.ParallelModel`). A synchronous server (``ps:S``) is checked step by step
with ``--check-parity`` (loss, gradient norm and every gradient against one process). A DGC plan (world 2) checks
that the program's clipping threshold reaches the hook as DGC's local clipping threshold. A stale one (``ps:S:K``)
against a single-process run written here by hand: each step's whole-batch gradient, computed on the parameters
of that step, is clipped and applied by AdamW ``K`` steps later (nothing is applied in the first ``K`` steps);
the loss of every step and every parameter at the end are compared by relative error.
"""

import json
import sys
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist
from support.training_loop import RunOptions, run_plan

from executors.precision import make_optimizer
from executors.session import init_distributed
from executors.training.feed import global_batch_on_rank0
from executors.training.parallel_model import parallelize
from planner.plan import Plan, load_plan

STEPS = 6
LR = 0.01
MAX_GRAD_NORM = 0.05


def stale_run(plan: Plan) -> dict:
    """The plan's losses and final parameters against the hand-written delayed single-process run (rank 0)."""
    model = parallelize(plan, device="cpu", seed=0, dropout=False)
    optimizer = make_optimizer("adam-fp32", model.parameters(), lr=LR)
    info = model.rank_info()
    batches = model.synthetic_batches(info)
    reference, ref_optimizer, queue = None, None, deque()
    if dist.get_rank() == 0:
        reference, _ = model.workload.build()
        ref_optimizer = make_optimizer("adam-fp32", list(reference.parameters()), lr=LR)
    losses, ref_losses = [], []
    for _ in range(STEPS):
        batch = next(batches)
        optimizer.zero_grad(set_to_none=True)
        losses.append(model.train_step(batch))
        model.clip_grad_norm_(MAX_GRAD_NORM)
        optimizer.step()
        model.after_optimizer_step()
        whole = global_batch_on_rank0(tuple(batch), info)
        if reference is not None:
            ref_losses.append(_reference_step(reference, ref_optimizer, whole, model, queue, plan.grad_sync.staleness))
    final = model.full_state_dict()
    if reference is None:
        return {}
    errors = {name: _relative(final[name], param.detach()) for name, param in reference.named_parameters()}
    return {"losses": losses, "reference_losses": ref_losses, "param_errors": errors}


def _reference_step(reference, optimizer, whole, model, queue: deque, staleness: int) -> float:
    workload = model.workload
    for param in reference.parameters():
        param.grad = None
    loss = workload.loss_fn(reference(*whole[: workload.num_inputs]), workload.loss_data(whole))
    loss.backward()
    queue.append({name: param.grad.clone() for name, param in reference.named_parameters()})
    for param in reference.parameters():
        param.grad = None
    if len(queue) > staleness:
        grads = queue.popleft()
        for name, param in reference.named_parameters():
            param.grad = grads[name]
        torch.nn.utils.clip_grad_norm_(list(reference.parameters()), MAX_GRAD_NORM)
        optimizer.step()
    return float(loss.detach())


def dgc_clip_run(plan: Plan) -> dict:
    """A DGC plan trained three steps with clipping: the threshold the program clips with reaches the hook as DGC's
    local clipping threshold (:meth:`executors.training.parallel_model.ParallelModel.clip_grad_norm_`)."""
    model = parallelize(plan, device="cpu", seed=0, dropout=False)
    optimizer = make_optimizer(plan.optimizer, model.parameters(), lr=LR, grad_sync=plan.grad_sync)
    batches = model.synthetic_batches(model.rank_info())
    before = model.runner.compressed_sync.max_grad_norm
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        model.train_step(next(batches))
        model.clip_grad_norm_(MAX_GRAD_NORM)
        optimizer.step()
    return {"dgc_local_clip": [before, model.runner.compressed_sync.max_grad_norm]}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / (want.norm() + 1e-12))


def main() -> None:
    out, *plans = sys.argv[1:]
    init_distributed(backend="gloo", timeout_s=120)
    torch.set_num_threads(1)
    report = {}
    for path in plans:
        plan = load_plan(path)
        if plan.grad_sync.kind == "dgc":
            report[path] = dgc_clip_run(plan)
            continue
        if plan.grad_sync.staleness:
            report[path] = stale_run(plan)
            continue
        options = RunOptions(steps=STEPS, check_parity=True, optimizer="adam-fp32", lr=LR, max_grad_norm=MAX_GRAD_NORM)
        results = run_plan(plan, options)
        report[path] = {"parity": [{"ok": r.parity.ok, "describe": r.parity.describe()} for r in results if r.parity]}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(report, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
