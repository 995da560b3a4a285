"""Count the collectives one training step of a tensor-parallel plan issues (CommDebugMode on each
rank) next to those the simulator charges (:func:`tests.support.charged_collectives.charged_collectives`)
and those the plan's JSON lists (its strategies' collectives and the resharding their specs imply,
read here from the file itself); rank 0 writes a JSON report.

``python -m torch.distributed.run --nproc-per-node N tests/collectives_worker.py OUT.json PLAN.json...``
"""

import json
import sys
from collections import Counter
from pathlib import Path

import torch.distributed as dist
from support.charged_collectives import charged_collectives, observed_kind
from torch.distributed.tensor.debug import CommDebugMode

from executors.graph_module import model_output
from executors.runner import TensorParallelRunner, load_cpu_runner
from executors.session import init_distributed
from planner.costing.setup import plan_setup


def _kinds(mode: CommDebugMode) -> dict[str, int]:
    observed = Counter()
    for op, count in mode.get_comm_counts().items():
        kind = observed_kind(str(op))
        if kind is not None and count:
            observed[kind] += count
    return dict(observed)


def plan_collectives(stage: dict, graph) -> dict[str, dict[str, int]]:
    """The collectives of one microbatch and step as the plan file lists them: every record's own, the
    resharding from each producer's output spec to the input spec its consumer's record names (per
    mesh axis: S->R all-gather forward; R->S all-gather of the gradient backward; S->S' all-to-all
    both ways; into R* (gathered) from anything else also an all-reduce of the gradient backward; from R*
    to a shard no other axis takes nothing; R* being R otherwise), and each parameter's sync collectives at
    its first reader."""
    strategies = stage["strategies"]
    needs_grad = set(graph.param_names)
    for node in graph.nodes:
        if node.output.is_floating and any(v in needs_grad for v in node.inputs):
            needs_grad.add(node.name)
    counts = {"forward": Counter(), "backward": Counter(), "sync": Counter()}
    synced = set()
    for node in graph.nodes:
        record = strategies[node.name]
        for position, value in enumerate(node.inputs):
            if value in graph.param_names and value not in synced:
                synced.add(value)
                counts["sync"].update(
                    c["kind"] for c in record["collectives"] if c["phase"] == "sync" and c["operand"] == position
                )
            need = record["input_specs"][position]
            if need is None or value not in strategies:
                continue
            for before, after in zip(strategies[value]["output_spec"], need, strict=True):
                if after == "R*" and before != "R*":  # a reader's partial gradient, all-reduced on the edge
                    counts["backward"]["all_reduce"] += value in needs_grad
                if before == "R*" and after.startswith("S") and need.count(after) == 1:
                    continue  # a gathered tensor sliced locally, its gradient handed back partial
                before, after = ("R" if p == "R*" else p for p in (before, after))
                if before == after:
                    continue
                if before == "R":
                    counts["backward"]["all_gather"] += value in needs_grad
                elif after == "R":
                    counts["forward"]["all_gather"] += 1
                else:
                    counts["forward"]["all_to_all"] += 1
                    counts["backward"]["all_to_all"] += value in needs_grad
        counts["forward"].update(c["kind"] for c in record["collectives"] if c["phase"] == "forward")
        counts["backward"].update(c["kind"] for c in record["collectives"] if c["phase"] == "backward")
    return {phase: {kind: n for kind, n in c.items() if n} for phase, c in counts.items()}


def main() -> None:
    out, *plans = sys.argv[1:]
    init_distributed(backend="gloo", timeout_s=120)
    report = {}
    for path in plans:
        workload, runner, inputs = load_cpu_runner(path)
        plan = workload.plan
        assert isinstance(runner, TensorParallelRunner) and plan.num_microbatches == 1
        phases = {}
        sharding = runner.part.sharding
        if runner.part.reducer is not None:  # every bucket in sync_grads, where the sync phase counts them
            runner.part.reducer.overlap = False
        with CommDebugMode() as phases["forward"]:  # the graph's nodes; gathering the output for the loss is not
            outputs = runner.part.module.inner(*(sharding.enter(value) for value in inputs))
        whole = tuple(sharding.leave(value) for value in outputs)
        loss = workload.loss_fn(model_output(workload.graph, whole), inputs)
        with CommDebugMode() as phases["backward"]:
            loss.backward()
        with CommDebugMode() as phases["sync"]:
            runner.part.sync_grads()
        graph = workload.graph_at(plan.batch_size)
        charged = charged_collectives(plan.stages[0], graph, plan_setup(plan), num_microbatches=1)
        listed = plan_collectives(json.loads(Path(path).read_text())["stages"][0], graph)
        report[path] = {
            phase: {"observed": _kinds(mode), "charged": dict(charged[phase]), "plan": listed[phase]}
            for phase, mode in phases.items()
        }
        report[path]["sync"]["charged_params"] = dict(charged["sync_params"])  # per parameter, as the plan lists
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(report, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
