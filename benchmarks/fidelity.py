"""Cost-model fidelity: each plan's predicted step time against the step measured when it runs.

For world sizes 2 and 4 on this machine, each with the cluster file ``plan calibrate --processes N``
writes (``benchmarks/results/cluster-local-N.json``; measured first when missing or with
``--calibrate``), every case below is planned for the optimizer it runs with (SGD), then run by our
executors (``executors.step_timing``, as ``plan run`` builds them) in one torchrun job per world
size: three warm-up steps, then the median of ``--steps`` timed steps (a barrier before each, the
slowest rank). The prediction is the plan's estimate and the simulator's replay of the plan.
Reported: per-plan error ``(predicted − measured) / measured``, the mean absolute percentage
error and Spearman's rank correlation over all plans. Targets (issue 7): Spearman ≥ 0.9, error ≤ 20%.

    python benchmarks/fidelity.py [--calibrate] [--steps 10] [--only CASE ...] [--worlds 2 4] [--save]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
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


def _degrees(kind: str, world: int) -> tuple[int, int, int]:
    return (world, 1, 1) if kind == "tensor" else (1, 2, world // 2)


def make_plans(cluster_file: Path, world: int, directory: Path, *, only: list[str] | None = None) -> dict[str, dict]:
    from cost_models.cluster import load_cluster
    from planner.api import plan_prepared, prepare_model_file
    from planner.lowering import simulate_plan
    from planner.plan import save_plan

    cluster = load_cluster(str(cluster_file), num_nodes=1, devices_per_node=world)
    rows = {}
    for name, (example, args, batch, method, options) in CASES.items():
        if only and name not in only:
            continue
        options = dict(options)
        if "degrees" in options:
            options["degrees"] = _degrees(options["degrees"], world)
        prepared = prepare_model_file(ROOT / "examples" / f"{example}.py", cluster, batch_size=batch,
                                      model_args=args, optimizer="sgd", **options)  # fmt: skip
        plan = plan_prepared(prepared, method)
        graph = prepared.graphs.at(batch // plan.num_microbatches)
        simulated = simulate_plan(plan, graph, prepared.setup).step_time_s
        path = directory / f"{name}-w{world}.json"
        save_plan(plan, path)
        rows[f"{name}@{world}"] = {"path": str(path), "estimate_s": plan.estimate.step_time_s,
                                   "simulated_s": simulated, "world": world, "method": plan.method}  # fmt: skip
    return rows


def measure(world: int, plans: list[str], *, steps: int, directory: Path) -> dict[str, float]:
    from executors.step_timing import run_timing

    return run_timing(plans, world=world, steps=steps, out=directory / f"measured-w{world}.json")


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


def cluster_file(world: int, *, recalibrate: bool) -> Path:
    """``plan calibrate --processes world`` for this machine, measured now when missing or asked for."""
    from executors.calibrate import run_calibration, write_cluster_file

    path = RESULTS / f"cluster-local-{world}.json"
    if recalibrate or not path.exists():
        print(f"calibrating {world} processes -> {path}", file=sys.stderr)
        result = run_calibration(num_processes=world, probe_steps=10, progress=lambda m: print(m, file=sys.stderr))
        write_cluster_file(result, path)
    return path


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
    parser.add_argument("--calibrate", action="store_true", help="re-measure the cluster files (plan calibrate)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per plan (after 3 warm-up steps)")
    parser.add_argument("--save", action="store_true", help="write the table and figure to benchmarks/results/")
    parser.add_argument("--only", nargs="+", choices=sorted(CASES), help="run only these cases (default: all)")
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4], choices=[2, 4], help="world sizes to run")
    args = parser.parse_args()
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as directory:
        for world in args.worlds:
            cluster = cluster_file(world, recalibrate=args.calibrate)
            planned = make_plans(cluster, world, Path(directory), only=args.only)
            print(f"world {world}: {len(planned)} plans, running...", file=sys.stderr)
            measured = measure(
                world, [r["path"] for r in planned.values()], steps=args.steps, directory=Path(directory)
            )
            for key, row in planned.items():
                rows[key] = {**row, "measured_s": measured[row["path"]]}
    table, summary = report(rows)
    print(table + "\n\n" + summary)
    if args.save:
        command = "python benchmarks/fidelity.py --calibrate --save"
        save_table("fidelity", title="Cost-model fidelity: predicted against measured step time", command=command,
                   description=DESCRIPTION + "\n\n" + summary, table=table)  # fmt: skip
        draw(rows, RESULTS / f"fidelity-{time.strftime('%Y-%m-%d')}.png")


DESCRIPTION = (
    "Each plan made on the cluster file `plan calibrate --processes N` wrote for its world size N (compute measured "
    "with all N processes running; executor overheads fitted on probe plans), run by the executors with gloo: median of the timed steps after 3 warm-up steps, slowest rank. *estimate*: the plan's estimate; "
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
    main()
