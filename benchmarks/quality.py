"""Plan quality: auto against every baseline on examples × clusters, beside the physical bound.

Each case (an example model at a global batch on 8, 16 or 64 GPUs of p3.16xlarge, dgx-a100 or
dgx-h100) runs in its own process: the model is prepared once and every method of
:data:`planner.compare.COMPARE_METHODS` plans on it and is replayed by the one discrete-event
simulator (:func:`planner.compare.compare`, what ``plan compare`` prints). Per method: the
simulated step time, model-FLOPs utilisation (model FLOPs of a step ÷ (step × devices × peak)),
simulated peak memory per device, and search seconds. Per case: the physical bound — the
model's forward+backward FLOPs of one step ÷ (devices × the device's peak FLOP/s at the training
dtype), no step can be faster — and auto's speedup over the best hand-written plan (the fastest
of data-parallel, megatron and uniform-pipeline that fits, by simulated step). Below the table:
the geometric mean of that speedup over every case where both exist.

    python -m benchmarks.quality [--cases gpt-1.3b@a100x64,...] [--rl-budget-s 10] [--quick]
                                 [--save]

``--save`` writes ``benchmarks/results/quality-<date>.md`` and the figure
``benchmarks/results/quality-<date>.png`` (auto vs best hand-written vs bound per case).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.quality_cases import ALPA, CASES, DEVICES_PER_NODE, QUICK, parse_case
from benchmarks.quality_report import geomean_line, save_page, speedup, speedup_over_alpa, summary_table

ROOT = Path(__file__).resolve().parent.parent


def worker(case: str, rl_budget_s: float) -> dict:
    from cost_models.cluster import load_cluster
    from planner.api import prepare_model_file
    from planner.compare import compare

    example, args, batch, cluster_name, nodes = parse_case(case)
    started = time.perf_counter()
    cluster = load_cluster(cluster_name, num_nodes=nodes, devices_per_node=DEVICES_PER_NODE)
    prepared = prepare_model_file(
        ROOT / "examples" / f"{example}.py", cluster, batch_size=batch, model_args=args, rl_budget_s=rl_budget_s
    )

    def progress(method: str) -> None:
        print(f"  {case}: {method} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)

    rows = compare(prepared, progress=progress)
    alpa = dataclasses.replace(prepared, options=dataclasses.replace(prepared.options, space="alpa"))  # narrowed
    progress(ALPA)
    rows.append(dataclasses.replace(compare(alpa, ("auto",))[0], method=ALPA))
    device = cluster.device
    dtype = "bfloat16" if device.mixed_precision else "float32"  # the training dtype, as planner.costing.estimate.mfu
    model_flops = prepared.graph.flops_fwd + prepared.graph.flops_bwd
    return {
        "case": case,
        "batch": batch,
        "devices": cluster.num_devices,
        "device": device.name,
        "dtype": dtype,
        "params": prepared.graph.num_params,
        "model_flops": model_flops,
        "bound_s": model_flops / (cluster.num_devices * device.peak(dtype)),
        "total_s": time.perf_counter() - started,
        "rows": [row.to_json() | {"plan": _plan_shape(row.plan)} for row in rows],
    }


def _plan_shape(plan) -> str:
    if plan is None:
        return ""
    if plan.schedule == "dataflow":
        return f"{len(plan.stages)} dev, m={plan.num_microbatches}"
    meshes = sorted({"×".join(map(str, stage.mesh_shape)) for stage in plan.stages})
    return f"{len(plan.stages)}×[{' '.join(meshes)}], m={plan.num_microbatches}"


def run(case: str, rl_budget_s: float) -> dict:
    """The worker's result in a fresh process, with its CPU seconds (the machine may be shared)."""
    command = [sys.executable, "-m", "benchmarks.quality", "--worker", case, "--rl-budget-s", str(rl_budget_s)]
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True, cwd=ROOT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return json.loads(result.stdout.strip().splitlines()[-1]) | {
        "cpu_s": cpu_s,
        "wall_s": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.quality", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated MODEL@CLUSTERxGPUS")
    parser.add_argument("--rl-budget-s", type=float, default=10.0, help="RL baseline's training seconds per case")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {', '.join(QUICK)} with RL for 2 s")
    parser.add_argument("--save", action="store_true", help="write the tables and the figure to benchmarks/results/")
    options = parser.parse_args()
    if options.worker:
        print(json.dumps(worker(options.worker, options.rl_budget_s)))
        return
    cases = list(QUICK) if options.quick else options.cases.split(",")
    rl_budget_s = 2.0 if options.quick else options.rl_budget_s
    for case in cases:
        parse_case(case)
    started = time.perf_counter()
    results = []
    for number, case in enumerate(cases, 1):
        print(
            f"[{number}/{len(cases)}] {case} ({time.perf_counter() - started:.0f} s so far)",
            file=sys.stderr,
            flush=True,
        )
        results.append(run(case, rl_budget_s))
        print(summary_table(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    wall_s = time.perf_counter() - started
    summary = summary_table(results)
    footer = f"{geomean_line(results, speedup, 'the best hand-written plan')}\n\n" + (
        f"{geomean_line(results, speedup_over_alpa, 'auto searching Alpa’s space alone (`--space alpa`)')}\n\n"
        f"Wall time of the run: {wall_s:.0f} s."
    )
    print(summary + "\n\n" + footer)
    if options.save:
        save_page(results, summary, footer, rl_budget_s)


if __name__ == "__main__":
    main()
