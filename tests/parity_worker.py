"""Run several plans under one torchrun job with --check-parity semantics; rank 0 writes a JSON report.

Used by the multi-process tests: ``python -m torch.distributed.run --nproc-per-node N
tests/parity_worker.py OUT.json PLAN.json...``. One job runs many plans so the ranks pay their
imports once.
"""

import json
import sys
import traceback
from pathlib import Path

import torch.distributed as dist
from support.training_loop import RunOptions, run_plan

from executors.session import init_distributed
from planner.plan import load_plan

STEPS = (
    2  # the second runs on what the first step updated (the optimizer, ZeRO's shards gathered back); 3 to 2026-11-28
)


def main() -> None:
    out, *plans = sys.argv[1:]
    init_distributed(backend="gloo", timeout_s=120)
    report = {}
    for path in plans:
        try:
            results = run_plan(load_plan(path), RunOptions(steps=STEPS, check_parity=True, optimizer="sgd", lr=0.05))
            report[path] = [
                {"loss": r.loss, "ok": r.parity.ok, "describe": r.parity.describe()} for r in results if r.parity
            ]
        except Exception as error:
            print(f"rank {dist.get_rank()} plan {path}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
            traceback.print_exc()
            raise
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(report, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
