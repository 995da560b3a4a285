"""Cost-model fidelity: each plan's predicted step time against the step measured when it runs.

For world sizes 2 and 4 on this machine, with the cluster file ``plan calibrate`` writes (measured
here first unless ``--cluster`` names one), every case below is planned, then run by our executors
(``executors.runner.make_runner``, as ``plan run`` does) in one torchrun job per world size: three
warm-up steps, then the median of ``--steps`` timed steps (a barrier before each; SGD). The
prediction is the plan's estimate and the simulator's replay of the plan. Reported: per-plan
error ``(predicted − measured) / measured``, the mean absolute percentage error and Spearman's
rank correlation over all plans. Targets (issue 7): Spearman ≥ 0.9, error ≤ 20%.

With more processes than cores each process gets ``cores / processes`` of a core, so the
calibrated device (one process alone) is scaled by that share (:func:`shared_cores`).

    python benchmarks/fidelity.py [--cluster FILE] [--steps 10] [--save]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from results_page import RESULTS, save_table  # noqa: E402

MLP = {"hidden": 512, "layers": 8}
GPT = {"size": "125m", "layers": 4, "hidden": 256, "heads": 4, "seq": 64, "vocab": 2048}
# name -> (example, model args, batch, method, planner options)
CASES = {
    "mlp-dp": ("mlp", MLP, 64, "data-parallel", {}),
    "mlp-tp": ("mlp", MLP, 64, "megatron", {"degrees": "tensor"}),
    "mlp-gpipe": ("mlp", MLP, 64, "megatron", {"degrees": "pipeline", "schedule": "gpipe", "microbatches": 4}),
    "mlp-auto": ("mlp", MLP, 64, "auto", {}),
    "gpt-dp": ("gpt", GPT, 8, "data-parallel", {}),
    "gpt-tp": ("gpt", GPT, 8, "megatron", {"degrees": "tensor"}),
    "gpt-1f1b": ("gpt", GPT, 8, "megatron", {"degrees": "pipeline", "schedule": "1f1b", "microbatches": 4}),
    "gpt-hash": ("gpt", GPT, 8, "hash", {}),
}


def shared_cores(cluster, *, processes: int, cores: int):
    """The cluster as ``processes`` devices on ``cores`` cores: each device gets a share of a core."""
    share = min(1.0, cores / processes)
    device = cluster.device
    scaled = replace(device, peak_flops={k: v * share for k, v in device.peak_flops.items()},
                     memory_bandwidth=device.memory_bandwidth * share)  # fmt: skip
    return replace(cluster, device=scaled)


def _degrees(kind: str, world: int) -> tuple[int, int, int]:
    return (world, 1, 1) if kind == "tensor" else (1, 2, world // 2)


def make_plans(cluster_file: Path, world: int, directory: Path) -> dict[str, dict]:
    from cost_models.cluster import load_cluster
    from planner.api import plan_prepared, prepare_model_file
    from planner.lowering import simulate_plan
    from planner.plan import save_plan

    cluster = shared_cores(load_cluster(str(cluster_file), num_nodes=1, devices_per_node=world),
                           processes=world, cores=os.cpu_count() or 1)  # fmt: skip
    rows = {}
    for name, (example, args, batch, method, options) in CASES.items():
        options = dict(options)
        if "degrees" in options:
            options["degrees"] = _degrees(options["degrees"], world)
        prepared = prepare_model_file(ROOT / "examples" / f"{example}.py", cluster, batch_size=batch,
                                      model_args=args, **options)  # fmt: skip
        plan = plan_prepared(prepared, method)
        graph = prepared.graphs.at(batch // plan.num_microbatches)
        simulated = simulate_plan(plan, graph, prepared.setup).step_time_s
        path = directory / f"{name}-w{world}.json"
        save_plan(plan, path)
        rows[f"{name}@{world}"] = {"path": str(path), "estimate_s": plan.estimate.step_time_s,
                                   "simulated_s": simulated, "world": world, "method": plan.method}  # fmt: skip
    return rows


def rank_worker(out: str, steps: int, plans: list[str]) -> None:
    """Inside torchrun: time every plan; rank 0 writes {plan: median seconds}."""
    import torch
    import torch.distributed as dist

    from executors.program import RunOptions
    from executors.runner import make_runner
    from executors.session import init_distributed, load_workload
    from planner.plan import load_plan

    init_distributed(backend="gloo", timeout_s=300)
    measured = {}
    for path in plans:
        plan = load_plan(path)
        workload = load_workload(plan, seed=0, device="cpu")
        model, inputs = workload.build()
        runner = make_runner(plan, workload, model)
        params = list(dict.fromkeys(runner.parameters()))
        optimizer = RunOptions().make_optimizer(params) if params else None
        times = []
        for step in range(3 + steps):
            dist.barrier()
            started = time.perf_counter()
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            runner.step(inputs)
            if optimizer is not None:
                optimizer.step()
            elapsed = torch.tensor(time.perf_counter() - started)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank does
            if step >= 3:
                times.append(float(elapsed))
        measured[path] = statistics.median(times)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(measured))
    dist.destroy_process_group()


def measure(world: int, plans: list[str], *, steps: int, directory: Path) -> dict[str, float]:
    from executors.launch import free_port

    out = directory / f"measured-w{world}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
               str(free_port()), __file__, "--rank-worker", str(out), str(steps), *plans]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        sys.exit(f"world {world} failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        result = [0.0] * len(values)
        for rank, index in enumerate(order):
            result[index] = float(rank)
        return result

    ra, rb = ranks(a), ranks(b)
    mean_a, mean_b = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - mean_a) * (y - mean_b) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - mean_a) ** 2 for x in ra) * sum((y - mean_b) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


def calibrate(path: Path) -> Path:
    from executors.calibrate import run_calibration, write_cluster_file

    result = run_calibration(num_processes=2, progress=lambda message: print(message, file=sys.stderr))
    return write_cluster_file(result, path)


def draw(rows: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 5))
    for key, row in rows.items():
        axis.scatter(row["measured_s"] * 1e3, row["estimate_s"] * 1e3, color="tab:blue")
        axis.annotate(key, (row["measured_s"] * 1e3, row["estimate_s"] * 1e3), fontsize=7)
    limit = max(max(r["measured_s"], r["estimate_s"]) for r in rows.values()) * 1e3 * 1.1
    axis.plot([0, limit], [0, limit], color="grey", linestyle="--", label="predicted = measured")
    axis.fill_between([0, limit], [0, 0.8 * limit], [0, 1.2 * limit], color="grey", alpha=0.15, label="±20%")
    axis.set(xlabel="measured step (ms)", ylabel="predicted step (ms)", title="Cost-model fidelity, this machine")
    axis.legend(loc="upper left")
    from cost_models.atomic_file import save_figure_atomic

    figure.tight_layout()
    try:
        save_figure_atomic(figure, path)
    finally:
        plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", type=Path, help="cluster file from `plan calibrate` (default: measure now)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per plan (after 3 warm-up steps)")
    parser.add_argument("--save", action="store_true", help="write the table and figure to benchmarks/results/")
    args = parser.parse_args()
    cluster = args.cluster or calibrate(RESULTS / "cluster-local.json")
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as directory:
        for world in (2, 4):
            planned = make_plans(cluster, world, Path(directory))
            print(f"world {world}: {len(planned)} plans, running...", file=sys.stderr)
            measured = measure(
                world, [r["path"] for r in planned.values()], steps=args.steps, directory=Path(directory)
            )
            for key, row in planned.items():
                rows[key] = {**row, "measured_s": measured[row["path"]]}
    table, summary = report(rows)
    print(table + "\n\n" + summary)
    if args.save:
        command = f"python benchmarks/fidelity.py --cluster {cluster.relative_to(ROOT) if cluster.is_relative_to(ROOT) else cluster} --save"
        save_table("fidelity", title="Cost-model fidelity: predicted against measured step time", command=command,
                   description=DESCRIPTION + "\n\n" + summary, table=table)  # fmt: skip
        draw(rows, RESULTS / f"fidelity-{time.strftime('%Y-%m-%d')}.png")


DESCRIPTION = (
    "Each plan made on the calibrated cluster (devices scaled to their share of the cores), run by the executors "
    "with gloo: median of the timed steps after 3 warm-up steps, slowest rank. *estimate*: the plan's estimate; "
    "*simulated*: the discrete-event replay of the plan; error = (estimate − measured) / measured."
)


def report(rows: dict[str, dict]) -> tuple[str, str]:
    lines = ["| plan | world | method | measured ms | estimate ms | error | simulated ms | error |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for key, row in rows.items():
        error = row["estimate_s"] / row["measured_s"] - 1
        sim_error = row["simulated_s"] / row["measured_s"] - 1
        lines.append(f"| {key} | {row['world']} | {row['method']} | {row['measured_s'] * 1e3:.1f} | "
                     f"{row['estimate_s'] * 1e3:.1f} | {error:+.0%} | {row['simulated_s'] * 1e3:.1f} | {sim_error:+.0%} |")  # fmt: skip
    measured = [r["measured_s"] for r in rows.values()]
    estimate = [r["estimate_s"] for r in rows.values()]
    simulated = [r["simulated_s"] for r in rows.values()]
    mape = statistics.fmean(abs(e / m - 1) for e, m in zip(estimate, measured, strict=True))
    sim_mape = statistics.fmean(abs(s / m - 1) for s, m in zip(simulated, measured, strict=True))
    worst = max(abs(e / m - 1) for e, m in zip(estimate, measured, strict=True))
    summary = (f"{len(rows)} plans. Estimate: MAPE {mape:.0%}, worst error {worst:.0%}, Spearman "
               f"{spearman(estimate, measured):.2f}. Simulated: MAPE {sim_mape:.0%}, Spearman "
               f"{spearman(simulated, measured):.2f}. Targets: Spearman ≥ 0.9, error ≤ 20%.")  # fmt: skip
    return "\n".join(lines), summary


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-worker":
        rank_worker(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
    else:
        main()
