"""Placements simulated per second: the batched simulator against the simulator, one placement at a time.

The RL placement baseline judges every placement it samples with
:func:`planner.baselines.placement.batched_simulator.simulate_placements`; issue 21 asks for at least
1,000 placements per second on GPT-350M in 256 groups on 8 devices. For each model (captured at
its ``plan compare`` batch, the microbatch count the placement methods use, grouped as the RL groups
it) this times batches of random placements (every group on a uniformly drawn device: many short
chunks, the slow case) and of contiguous ones (pipelines of 2 rounds with random cut points: what
the policy mostly draws), and the per-placement simulator
(:func:`planner.baselines.placement.dataflow.simulate_assignment`) on a few of the same placements,
checking that both give the same step times. Compilation (the first call) is timed apart; every
timing is repeated ``--repeats`` times and the median kept (all listed).

    python -m benchmarks.placement_sim [--batch 1024] [--repeats 5] [--save]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.results_page import save_table

ROOT = Path(__file__).resolve().parent.parent

# name -> (example, model args, batch size, cluster, nodes, devices per node)
CASES = {
    "gpt-350m@p3x8": ("gpt", {"size": "350m"}, 32, "p3.16xlarge", 1, 8),
    "gpt-1.3b@a100x16": ("gpt", {"size": "1.3b"}, 64, "dgx-a100", 2, 8),
    "resnet@p3x8": ("resnet", {}, 256, "p3.16xlarge", 1, 8),
}
PER_PLACEMENT = 20  # placements timed with the per-placement simulator


def grouped_problem(case: str):
    from cost_models.cluster import load_cluster
    from planner.api import prepare_model_file
    from planner.baselines.placement.methods import placement_microbatches
    from planner.baselines.placement.problem import placement_problem
    from planner.baselines.placement.rl import group_ops, group_problem, num_groups

    example, args, batch, cluster_name, nodes, per_node = CASES[case]
    cluster = load_cluster(cluster_name, num_nodes=nodes, devices_per_node=per_node)
    prepared = prepare_model_file(ROOT / "examples" / f"{example}.py", cluster, batch_size=batch, model_args=args)
    m = placement_microbatches(batch, cluster.num_devices, None)
    problem = placement_problem(prepared.graphs.at(batch // m), prepared.setup, num_microbatches=m)
    return group_problem(problem, group_ops(problem, num_groups(problem))), m


def placements(kind: str, *, count: int, groups: int, devices: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "random":
        return rng.integers(0, devices, size=(count, groups))
    cuts = rng.random((count, groups)) < min(0.5, 2 * devices / groups)  # about two rounds over the devices
    cuts[:, 0] = False
    return np.cumsum(cuts, axis=1) % devices


def timed(function, repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - started)
    return seconds


def measure(case: str, *, batch: int, repeats: int) -> list[list[str]]:
    from planner.baselines.placement.batched_simulator import simulate_placements
    from planner.baselines.placement.dataflow import simulate_assignment

    problem, m = grouped_problem(case)
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    simulate_placements(
        problem, placements("random", count=1, groups=problem.num_ops, devices=problem.num_devices, rng=rng)
    )
    first_s = time.perf_counter() - started
    rows = []
    for kind in ("random", "contiguous"):
        batch_rows = placements(kind, count=batch, groups=problem.num_ops, devices=problem.num_devices, rng=rng)
        batched = timed(lambda rows=batch_rows: simulate_placements(problem, rows), repeats)
        few = batch_rows[:PER_PLACEMENT]
        single = timed(lambda few=few: [simulate_assignment(problem, row.tolist()) for row in few], repeats)
        same = all(
            simulate_assignment(problem, row.tolist()).step_time_s == step
            for row, step in zip(few, simulate_placements(problem, few).step_time_s, strict=True)
        )
        batched_rate = batch / statistics.median(batched)
        single_rate = len(few) / statistics.median(single)
        rows.append(
            [
                case,
                str(problem.num_ops),
                str(problem.num_devices),
                str(m),
                kind,
                f"{batched_rate:,.0f}",
                f"{single_rate:,.1f}",
                f"{batched_rate / single_rate:,.0f}×",
                "yes" if same else "**no**",
                " ".join(f"{s:.3f}" for s in batched),
                f"{first_s:.1f}",
            ]
        )
        print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.placement_sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--batch", type=int, default=1024, help="placements per batched call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--save", action="store_true", help="write the table to benchmarks/results/")
    options = parser.parse_args()
    header = [
        "case",
        "groups",
        "devices",
        "microbatches",
        "placements",
        "batched /s",
        "one at a time /s",
        "ratio",
        "same step times",
        f"batched s per {options.batch} (all repeats)",
        "first call s (compile)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for case in options.cases.split(","):
        lines += ["| " + " | ".join(row) + " |" for row in measure(case, batch=options.batch, repeats=options.repeats)]
    text = "\n".join(lines)
    print(text)
    if options.save:
        load = os.getloadavg()
        description = (
            "Placements per second of the RL baseline's batched simulator (`planner/baselines/placement/"
            "batched_simulator.py`, numba, threads over the batch) and of the per-placement simulator it replaces "
            f"(`dataflow.simulate_assignment`, {PER_PLACEMENT} placements), on the grouped problems the RL searches. "
            "*random*: each group on a uniformly drawn device; *contiguous*: pipelines of about two rounds with random "
            "cut points. Medians of the repeats; *first call* includes numba's compilation, or loading it from its "
            f"on-disk cache. Load average while measuring: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}."
        )
        command = "python -m benchmarks.placement_sim " + " ".join(sys.argv[1:])
        save_table(
            "placement_sim", title="Batched placement simulation", command=command, description=description, table=text
        )


if __name__ == "__main__":
    main()
