"""RL placement learning curves on the ``plan compare`` cases: reward against seconds and against updates.

For each case of ``benchmarks/compare.py`` (the same model, batch, cluster and microbatch count as
``plan compare`` gives the placement methods) this runs :func:`planner.baselines.placement.rl.rl_placement`
for ``--budget-s`` seconds with ``--seed``, in a fresh process (so numba's compile, or loading it
from its disk cache, counts in the budget as it does in ``plan compare``), and the four heuristics.
It plots, per case, the mean reward of each update's samples against seconds and against updates,
and the fastest fitting placement so far as a multiple of the best heuristic's step, and tabulates
the final placement against every heuristic. With ``--repeat`` it runs each case a second time with
``--rl-iterations`` set to the first run's update count and checks that the placement is the same.

    python -m benchmarks.rl_curves [--budget-s 60] [--seed 0] [--cases ...] [--repeat] [--save]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.compare import CASES
from benchmarks.results_page import RESULTS, save_table

ROOT = Path(__file__).resolve().parent.parent

CURVE_POINTS = 600  # points kept per curve (evenly spaced updates, the last included)
TARGET = 0.9  # issue 21: at least 10% faster than the best heuristic


def worker(case: str, *, budget_s: float, seed: int, iterations: int | None) -> dict:
    from cost_models.cluster import load_cluster
    from planner.api import prepare_model_file
    from planner.baselines.placement.dataflow import simulate_assignment
    from planner.baselines.placement.methods import HEURISTICS, placement_microbatches
    from planner.baselines.placement.problem import fits, placement_problem
    from planner.baselines.placement.rl import rl_placement

    example, args, batch, cluster_name, nodes, per_node = CASES[case]
    cluster = load_cluster(cluster_name, num_nodes=nodes, devices_per_node=per_node)
    prepared = prepare_model_file(ROOT / "examples" / f"{example}.py", cluster, batch_size=batch, model_args=args)
    m = placement_microbatches(batch, cluster.num_devices, None)
    problem = placement_problem(prepared.graphs.at(batch // m), prepared.setup, num_microbatches=m)
    heuristics = {}
    for name, place in HEURISTICS.items():
        assignment = place(problem)
        heuristics[name] = simulate_assignment(problem, assignment).step_time_s if fits(problem, assignment) else None
    result = rl_placement(
        problem, budget_s=float("inf") if iterations else budget_s, seed=seed, max_iterations=iterations
    )
    kept = kept_updates(result.iterations)
    return {
        "case": case,
        "num_ops": problem.num_ops,
        "microbatches": m,
        "heuristics": heuristics,
        "rl_step_s": result.step_time_s,
        "assignment": list(result.assignment),
        "iterations": result.iterations,
        "simulations": result.num_simulations,
        "time_s": result.time_s,
        "updates": [k + 1 for k in kept],
        "mean_reward": [result.mean_reward[k] for k in kept],
        "elapsed_s": [result.elapsed_s[k] for k in kept],
        "best_step_s": [result.best_step_s[k] for k in kept],
    }


def kept_updates(count: int) -> list[int]:
    """Indices of the updates whose points are kept: every update's curve is too big to save. Evenly spaced
    ones (the seconds axis) and geometrically spaced ones (the log updates axis), the first and last included."""
    every = max(1, count // CURVE_POINTS)
    geometric = {int(x) - 1 for x in np.geomspace(1, count, CURVE_POINTS // 2)}
    return sorted({*range(0, count, every), *geometric, count - 1})


def run(case: str, *, budget_s: float, seed: int, iterations: int | None = None) -> dict:
    command = [
        sys.executable,
        "-m",
        "benchmarks.rl_curves",
        "--worker",
        case,
        "--budget-s",
        str(budget_s),
        "--seed",
        str(seed),
    ]
    if iterations:
        command += ["--rl-iterations", str(iterations)]
    result = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(result.stdout.strip().splitlines()[-1])


def row(result: dict, again: dict | None) -> str:
    heuristics = {name: s for name, s in result["heuristics"].items() if s is not None}
    best_name = min(heuristics, key=heuristics.get)
    ratio = result["rl_step_s"] / heuristics[best_name]
    cells = [f"{result['rl_step_s'] / s:.3f}" if s else "✗" for s in result["heuristics"].values()]
    same = "—" if again is None else ("yes" if again["assignment"] == result["assignment"] else "**no**")
    return (
        f"| {result['case']} | {result['num_ops']} | {result['microbatches']} | {result['rl_step_s']:.4g} | "
        + " | ".join(cells)
        + f" | {best_name} | **{ratio:.3f}** | {'yes' if ratio <= TARGET else '**no**'} | "
        f"{result['iterations']} | {result['simulations']:,} | {result['time_s']:.1f} | {same} |"
    )


def figure(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    for result in results:
        best = min(s for s in result["heuristics"].values() if s is not None)
        updates = result["updates"]
        axes[0].plot(result["elapsed_s"], result["mean_reward"], label=result["case"], linewidth=0.8)
        axes[1].plot(updates, result["mean_reward"], label=result["case"], linewidth=0.8)
        axes[2].plot(result["elapsed_s"], [s / best for s in result["best_step_s"]], label=result["case"])
    axes[0].set(xlabel="seconds", ylabel="mean reward of the update's samples, −√(R'/T₁)", title="reward vs seconds")
    axes[1].set(xlabel="policy updates", ylabel="mean reward", xscale="log", title="reward vs updates")
    axes[2].axhline(TARGET, color="black", linestyle="--", linewidth=0.8, label="10% faster than the best heuristic")
    axes[2].set(
        xlabel="seconds",
        ylabel="fastest placement so far ÷ best heuristic",
        ylim=(0.6, 1.2),
        title="best placement vs seconds",
    )
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.rl_curves", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rl-iterations", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names of compare.py")
    parser.add_argument("--budget-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", action="store_true", help="rerun with the update count fixed: same placement?")
    parser.add_argument("--save", action="store_true", help="write the table, figure and curves to benchmarks/results/")
    options = parser.parse_args()
    if options.worker:
        print(
            json.dumps(
                worker(options.worker, budget_s=options.budget_s, seed=options.seed, iterations=options.rl_iterations)
            )
        )
        return
    header = [
        "case",
        "ops",
        "microbatches",
        "rl step s",
        "÷ hash",
        "÷ critical-path",
        "÷ multi-objective",
        "÷ m-etf",
        "best heuristic",
        "rl ÷ best",
        "≥ 10% faster",
        "updates",
        "simulations",
        "rl s",
        "same placement again",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    results = []
    for case in options.cases.split(","):
        started = time.perf_counter()
        results.append(run(case, budget_s=options.budget_s, seed=options.seed))
        again = None
        if options.repeat:
            again = run(case, budget_s=options.budget_s, seed=options.seed, iterations=results[-1]["iterations"])
        lines.append(row(results[-1], again))
        print(lines[-1], f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    text = "\n".join(lines)
    print(text)
    if options.save:
        _save_page(results, text, budget_s=options.budget_s, seed=options.seed)


def _save_page(results: list[dict], text: str, *, budget_s: float, seed: int) -> None:
    """Write the table, the figure and the curves to benchmarks/results/."""
    today = datetime.date.today().isoformat()
    figure(results, RESULTS / f"rl_curves-{today}.png")
    (RESULTS / f"rl_curves-{today}.json").write_text(json.dumps(results))
    load = os.getloadavg()
    description = (
        f"RL placement (`planner/baselines/placement/rl.py`) for {budget_s:g} s per case (wall clock, one "
        "process per case, numba's compile or cache load included), seed "
        f"{seed}, on the `benchmarks/compare.py` cases; cells *÷ method* are RL's simulated step over that "
        "heuristic's (✗: its placement does not fit); *rl ÷ best* against the fastest heuristic that fits; target "
        "≤ 0.9 on at least 6 of 8 and ≤ 1 against hash everywhere. No warm start from a heuristic: restarts begin "
        "from the search's own best placement. *same placement again*: a second run stopped at the first run's "
        f"update count (`--rl-iterations`). Load average while measuring: {load[0]:.2f}, {load[1]:.2f}, "
        f"{load[2]:.2f}. Figure: [rl_curves-{today}.png](rl_curves-{today}.png); curves at about "
        f"{CURVE_POINTS} evenly and {CURVE_POINTS // 2} geometrically spaced updates per case: "
        f"[json](rl_curves-{today}.json)."
    )
    command = "python -m benchmarks.rl_curves " + " ".join(sys.argv[1:])
    save_table("rl_curves", title="RL placement learning curves", command=command, description=description, table=text)


if __name__ == "__main__":
    main()
