"""Train several plans for a few hundred steps under one torchrun job; rank 0 writes every step's loss.

Used by ``tests/test_lossy_sync.py``: ``python -m torch.distributed.run --nproc-per-node N
tests/lossy_worker.py OUT.json STEPS PLAN.json...``. Each plan runs the real training loop
(:func:`support.training_loop.run_plan`: the plan's executor, optimizer and gradient sync, local SGD's
parameter average after each optimizer step) from the same seed.
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist
from support.training_loop import RunOptions, run_plan

from executors.session import init_distributed
from planner.plan import load_plan


def main() -> None:
    out, steps, *plans = sys.argv[1:]
    init_distributed(backend="gloo", timeout_s=120)
    report = {}
    for path in plans:
        results = run_plan(load_plan(path), RunOptions(steps=int(steps), lr=0.01, seed=0))
        report[path] = [result.loss for result in results]
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
