"""Count the collectives one training step of a tensor-parallel plan issues (CommDebugMode on each
rank) next to those the cost model charges; rank 0 writes a JSON report.

``python -m torch.distributed.run --nproc-per-node N tests/collectives_worker.py OUT.json PLAN.json...``
"""

import json
import sys
from collections import Counter
from pathlib import Path

import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from executors.graph_module import flat_outputs
from executors.runner import TensorParallelRunner, make_runner
from executors.session import init_distributed, load_workload
from executors.tensor_parallel import observed_kind
from planner.costing.collectives import charged_collectives
from planner.plan import load_plan


def _kinds(mode: CommDebugMode) -> dict[str, int]:
    observed = Counter()
    for op, count in mode.get_comm_counts().items():
        kind = observed_kind(str(op))
        if kind is not None and count:
            observed[kind] += count
    return dict(observed)


def main() -> None:
    out, *plans = sys.argv[1:]
    init_distributed(backend="gloo", timeout_s=120)
    report = {}
    for path in plans:
        plan = load_plan(path)
        workload = load_workload(plan, seed=0, device="cpu")
        model, inputs = workload.build()
        runner = make_runner(plan, workload, model)
        assert isinstance(runner, TensorParallelRunner) and plan.num_microbatches == 1
        phases = {}
        sharding = runner.part.sharding
        with CommDebugMode() as phases["forward"]:  # the graph's nodes; gathering the output for the loss is not
            outputs = runner.part.module.inner(*(sharding.enter(value) for value in inputs))
        whole = tuple(sharding.leave(value) for value in outputs)
        loss = workload.loss_fn(flat_outputs(whole), inputs)
        with CommDebugMode() as phases["backward"]:
            loss.backward()
        with CommDebugMode() as phases["sync"]:
            runner.part.sync_grads()
        graph = workload.graph_at(plan.batch_size)
        charged = charged_collectives(plan.stages[0], graph, num_microbatches=1)
        report[path] = {
            phase: {"observed": _kinds(mode), "charged": dict(charged[phase])} for phase, mode in phases.items()
        }
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(report, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
