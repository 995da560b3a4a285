"""Train plans that differ only in their gradient sync, evaluate each on held-out data (one torchrun job).

``python -m torch.distributed.run --nproc-per-node N benchmarks/compression_worker.py OUT.json STEPS LR EVAL.py
PLAN.json[@no-correction]...`` — used by ``benchmarks/compression_accuracy.py``. Every plan trains ``STEPS`` steps
from the same seed with its optimizer (the plan's) at learning rate ``LR``, the model file's own data feed; rank 0
records the loss of every step, then evaluates the trained weights (``ParallelModel.full_state_dict`` into a fresh
model) with ``EVAL.py``'s ``evaluate(model)``. ``@no-correction`` runs DGA without its correction term (the
ablation of Zhu et al.: each replica steps on the average from ``D`` steps before alone).
"""

import functools
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from executors import delayed_sync
from executors.parallel import grad_sync as grad_sync_module
from executors.precision import Precision, make_optimizer
from executors.session import init_distributed
from executors.training.parallel_model import parallelize
from planner.plan import load_plan


def evaluator(path: str):
    spec = importlib.util.spec_from_file_location("evaluated_model_file", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train(plan_arg: str, *, steps: int, lr: float, evaluated) -> dict:
    path, _, variant = plan_arg.partition("@")
    plan = load_plan(path)
    correction = variant != "no-correction"
    grad_sync_module.DelayedState = functools.partial(delayed_sync.DelayedState, correction=correction)
    model = parallelize(plan, device="cpu", seed=0, precision=Precision.for_optimizer(plan.optimizer), dropout=False)
    optimizer = make_optimizer(plan.optimizer, model.parameters(), lr=lr, grad_sync=plan.grad_sync)
    batches = model.synthetic_batches(model.rank_info())
    losses, started = [], time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        losses.append(model.train_step(next(batches)))
        optimizer.step()
        model.after_optimizer_step()
    wall_s = time.perf_counter() - started
    weights = model.full_state_dict()
    result = {"losses": losses, "wall_s": wall_s}
    if dist.get_rank() == 0:
        fresh = evaluated.build_model()
        fresh.load_state_dict(weights)
        result.update(evaluated.evaluate(fresh.eval()))
    return result


def main() -> None:
    out, steps, lr, evaluated_path, *plans = sys.argv[1:]
    init_distributed(backend="gloo", timeout_s=300)
    torch.set_num_threads(1)
    evaluated = evaluator(evaluated_path)
    report = {plan: train(plan, steps=int(steps), lr=float(lr), evaluated=evaluated) for plan in plans}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
