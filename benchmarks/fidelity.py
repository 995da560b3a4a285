"""Cost-model fidelity: each plan's predicted step time against the step measured when it runs.

For world sizes 2 and 4 on this machine, each with the cluster file ``plan calibrate --processes N``
writes (``benchmarks/results/cluster-local-N.json``; measured first when missing or with
``--calibrate``), every case below is planned for the optimizer it runs with (SGD), then run by our
executors (``executors.step_timing``, as ``plan run`` builds them) in one torchrun job per world
size: three warm-up steps, then the median of ``--steps`` timed steps (a barrier before each, the
slowest rank). Plans are made with ``--cost-model`` (default ``profiled``: each operator timed on
this machine at every microbatch size the search prices, by one process, times the cluster file's
``shared_slowdown``). The prediction is the plan's estimate and the simulator's replay of the plan;
the replay with roofline compute times shows what the operator profiles add. Reported: per-plan error ``(predicted − measured) / measured``, the mean absolute percentage
error and Spearman's rank correlation over all plans. On a virtual machine the host may take CPU
time (``steal`` in /proc/stat); a world's timings are re-run while it took more than ``--max-steal``,
and the page states the share of the run it kept. Targets (issue 7): Spearman ≥ 0.9, error ≤ 20%.

    python benchmarks/fidelity.py [--calibrate] [--cost-model profiled|roofline] [--steps 10]
                                  [--only CASE ...] [--worlds 2 4] [--max-steal 0.05] [--attempts 3] [--save]
    python benchmarks/fidelity.py --draw-from benchmarks/results/fidelity-DATE.md   (redraw the figure only)
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


def make_plans(
    cluster_file: Path, world: int, directory: Path, *, cost_model: str, only: list[str] | None = None
) -> dict[str, dict]:
    from dataclasses import replace

    from cost_models.cluster import load_cluster
    from cost_models.compute import RooflineCompute
    from planner.api import plan_prepared, prepare_model_file
    from planner.costing.lowering import simulate_plan
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
                                      model_args=args, optimizer="sgd", cost_model=cost_model, **options)  # fmt: skip
        plan = plan_prepared(prepared, method)
        graph = prepared.graphs.at(batch // plan.num_microbatches)
        simulated = simulate_plan(plan, graph, prepared.setup).step_time_s
        roofline = replace(prepared.setup, compute=RooflineCompute(device=cluster.device))
        path = directory / f"{name}-w{world}.json"
        save_plan(plan, path)
        rows[f"{name}@{world}"] = {"path": str(path), "estimate_s": plan.estimate.step_time_s,
                                   "simulated_s": simulated, "roofline_s": simulate_plan(plan, graph, roofline).step_time_s,
                                   "world": world, "method": plan.method}  # fmt: skip
    return rows


def measure(world: int, plans: list[str], *, steps: int, directory: Path) -> dict[str, float]:
    from executors.step_timing import run_timing

    return run_timing(plans, world=world, steps=steps, out=directory / f"measured-w{world}.json")


def cpu_ticks() -> tuple[int, int] | None:
    """(stolen, total) CPU ticks since boot from /proc/stat (None off Linux): a virtual machine's
    host can take CPU time from it, which slows every measured step and no cost model foresees."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields)


def stolen_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def measure_quietly(
    world: int, plans: list[str], *, steps: int, directory: Path, max_steal: float, attempts: int
) -> tuple[dict[str, float], float | None]:
    """:func:`measure`, again (up to ``attempts`` runs) while the host stole more than ``max_steal`` of
    the CPU time; the run with the least stolen is kept, with its share."""
    kept: tuple[dict[str, float], float | None] | None = None
    for attempt in range(1, attempts + 1):
        print(f"world {world}: {len(plans)} plans, running (attempt {attempt})...", file=sys.stderr)
        before = cpu_ticks()
        measured = measure(world, plans, steps=steps, directory=directory)
        share = stolen_share(before, cpu_ticks())
        if kept is None or (share is not None and kept[1] is not None and share < kept[1]):
            kept = (measured, share)
        if share is None or share <= max_steal:
            break
        print(f"world {world}: the host took {share:.1%} of the CPU time, more than {max_steal:.0%}", file=sys.stderr)
    assert kept is not None
    return kept


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
    from executors.calibrate import write_cluster_file
    from planner.cli.calibrate import calibrate_machine

    path = RESULTS / f"cluster-local-{world}.json"
    if recalibrate or not path.exists():
        print(f"calibrating {world} processes -> {path}", file=sys.stderr)
        result = calibrate_machine(num_processes=world, probe_steps=10, progress=lambda m: print(m, file=sys.stderr))
        write_cluster_file(result, path)
    return path


def draw(rows: dict[str, dict], path: Path) -> None:
    """Predicted (the estimate) against measured step time, log-log, one colour per world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullFormatter

    from cost_models.atomic_file import save_figure_atomic

    figure, axis = plt.subplots(figsize=(6.5, 5.5))
    colors = {2: "tab:blue", 4: "tab:orange"}
    for world in sorted({r["world"] for r in rows.values()}):
        color = colors.get(world, "tab:green")
        picked = {key: row for key, row in rows.items() if row["world"] == world}
        measured = [row["measured_s"] * 1e3 for row in picked.values()]
        predicted = [row["estimate_s"] * 1e3 for row in picked.values()]
        axis.scatter(measured, predicted, color=color, label=f"{world} processes", zorder=3)
        for key, x, y in zip(picked, measured, predicted, strict=True):
            axis.annotate(key.split("@")[0], (x, y), fontsize=7, xytext=(4, -3), textcoords="offset points")
    values = [row[k] * 1e3 for row in rows.values() for k in ("measured_s", "estimate_s")]
    low, high = min(values) / 1.3, max(values) * 1.3
    axis.plot([low, high], [low, high], color="grey", linestyle="--", label="predicted = measured")
    axis.fill_between([low, high], [0.8 * low, 0.8 * high], [1.2 * low, 1.2 * high], color="grey", alpha=0.15,
                      label="±20%")  # fmt: skip
    axis.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high), xlabel="measured step (ms)",
             ylabel="predicted step (ms)", title="Cost-model fidelity on this machine (estimate)")  # fmt: skip
    ticks = [t for t in (25, 50, 100, 200, 400, 800, 1600, 3200) if low <= t <= high]
    for scale in (axis.xaxis, axis.yaxis):
        scale.set_major_locator(FixedLocator(ticks))
        scale.set_major_formatter(FormatStrFormatter("%g"))
        scale.set_minor_formatter(NullFormatter())
    axis.legend(loc="upper left")
    figure.tight_layout()
    try:
        save_figure_atomic(figure, path)
    finally:
        plt.close(figure)


def rows_from_table(path: Path) -> dict[str, dict]:
    """The rows of a saved fidelity page (``--draw-from``): plan, world, measured and estimate."""
    rows = {}
    for line in path.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and "@" in cells[0] and cells[1].isdigit():
            rows[cells[0]] = {"world": int(cells[1]), "measured_s": float(cells[3]) / 1e3,
                              "estimate_s": float(cells[4]) / 1e3}  # fmt: skip
    if not rows:
        raise SystemExit(f"{path} holds no fidelity table rows")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibrate", action="store_true", help="re-measure the cluster files (plan calibrate)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per plan (after 3 warm-up steps)")
    parser.add_argument("--save", action="store_true", help="write the table and figure to benchmarks/results/")
    parser.add_argument("--only", nargs="+", choices=sorted(CASES), help="run only these cases (default: all)")
    parser.add_argument(
        "--cost-model",
        choices=("profiled", "roofline"),
        default="profiled",
        help="compute times the plans are made and estimated with (the roofline is also simulated)",
    )
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4], choices=[2, 4], help="world sizes to run")
    parser.add_argument(
        "--max-steal",
        type=float,
        default=0.05,
        metavar="SHARE",
        help="re-run a world's timings while the VM's host took more CPU time than this (default 0.05)",
    )
    parser.add_argument("--attempts", type=int, default=3, help="timing runs per world at most (default 3)")
    parser.add_argument("--draw-from", type=Path, metavar="FILE.md", help="only redraw the figure of a saved page")
    args = parser.parse_args()
    if args.draw_from:
        draw(rows_from_table(args.draw_from), args.draw_from.with_suffix(".png"))
        print(f"wrote {args.draw_from.with_suffix('.png')}")
        return
    rows: dict[str, dict] = {}
    stolen: dict[int, float | None] = {}
    with tempfile.TemporaryDirectory() as directory:
        for world in args.worlds:
            cluster = cluster_file(world, recalibrate=args.calibrate)
            planned = make_plans(cluster, world, Path(directory), cost_model=args.cost_model, only=args.only)
            measured, stolen[world] = measure_quietly(
                world, [r["path"] for r in planned.values()], steps=args.steps, directory=Path(directory),
                max_steal=args.max_steal, attempts=args.attempts,
            )  # fmt: skip
            for key, row in planned.items():
                rows[key] = {**row, "measured_s": measured[row["path"]]}
    table, summary = report(rows)
    shares = ", ".join(f"{share:.1%} at world {world}" for world, share in stolen.items() if share is not None)
    if shares:
        summary += f" CPU time the virtual machine's host took during the timed runs (/proc/stat steal): {shares}."
    print(table + "\n\n" + summary)
    if args.save:
        command = " ".join(["python benchmarks/fidelity.py", *sys.argv[1:]])
        save_table("fidelity", title="Cost-model fidelity: predicted against measured step time", command=command,
                   description=DESCRIPTION + "\n\n" + summary, table=table)  # fmt: skip
        draw(rows, RESULTS / f"fidelity-{time.strftime('%Y-%m-%d')}.png")


DESCRIPTION = (
    "Each plan made on the cluster file `plan calibrate --processes N` wrote for its world size N (compute measured "
    "with all N processes running, and alone for the shared slowdown; executor overheads fitted on probe plans) with "
    "operator times profiled on this machine, run by the executors with gloo: median of the timed steps after 3 "
    "warm-up steps, slowest rank. *estimate*: the plan's estimate; *simulated*: the discrete-event replay of the "
    "plan; *roofline simulated*: the replay with the calibrated roofline's compute times instead of the profiles; "
    "error = (predicted − measured) / measured."
)


def report(rows: dict[str, dict]) -> tuple[str, str]:
    columns = (("estimate_s", "estimate"), ("simulated_s", "simulated"), ("roofline_s", "roofline simulated"))
    lines = ["| plan | world | method | measured ms | " + " | ".join(f"{title} ms | error" for _, title in columns) + " |",
             "|---|---|---|---|" + "---|---|" * len(columns)]  # fmt: skip
    for key, row in rows.items():
        cells = [f"{row[field] * 1e3:.1f} | {row[field] / row['measured_s'] - 1:+.0%}" for field, _ in columns]
        lines.append(
            f"| {key} | {row['world']} | {row['method']} | {row['measured_s'] * 1e3:.1f} | " + " | ".join(cells) + " |"
        )
    measured = [r["measured_s"] for r in rows.values()]

    def summary_of(field: str, title: str) -> str:
        predicted = [r[field] for r in rows.values()]
        errors = [abs(p / m - 1) for p, m in zip(predicted, measured, strict=True)]
        return (f"{title}: MAPE {statistics.fmean(errors):.0%}, worst error {max(errors):.0%}, "
                f"Spearman {spearman(predicted, measured):.2f}")  # fmt: skip

    summary = f"{len(rows)} plans. " + ". ".join(summary_of(f, t.capitalize()) for f, t in columns)
    return "\n".join(lines), summary + ". Targets: Spearman ≥ 0.9, error ≤ 20%."


if __name__ == "__main__":
    main()
