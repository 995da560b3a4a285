"""Gradient sync choices priced: exact against bf16, PowerSGD and local SGD (issue 20, item 4).

For each cluster, the model is captured once and ``auto`` plans it under every gradient sync, forced
(``--allow-lossy --grad-sync X``: every candidate runs X, and one that cannot, such as local SGD on anything
but a one-stage data-parallel plan, is left out), then once free to choose (``--allow-lossy``). Per row: the
estimated step, the plan's shape, and the step against exact sync. Roofline costs, nothing run: figures are
the cost model's (:mod:`planner.costing.compression`, :mod:`planner.inter.grad_sync_choice`).

    python -m benchmarks.grad_sync [--clusters p3.16xlarge:4,dgx-a100:8] [--batch 128] [--save]

``--save`` writes ``benchmarks/results/grad_sync-<date>.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from benchmarks.results_page import save_table

ROOT = Path(__file__).resolve().parent.parent

CHOICES = ("exact", "bf16", "powersgd:1", "powersgd:4", "powersgd:16", "local-sgd:4", "local-sgd:16")
MODEL = ("gpt", {"size": "1.3b"})


def rows_for(cluster_name: str, nodes: int, *, batch: int) -> list[list[str]]:
    from cost_models.cluster import load_cluster
    from planner.api import plan_prepared, prepare_model_file
    from planner.errors import AutoplanError
    from planner.plan import GradSync
    from planner.plan.shape import plan_shape

    cluster = load_cluster(cluster_name, num_nodes=nodes)
    example, args = MODEL
    prepared = prepare_model_file(
        ROOT / "examples" / f"{example}.py", cluster, batch_size=batch, model_args=args, allow_lossy=True
    )
    base = prepared.options
    rows, exact_s = [], None
    for choice in (*CHOICES, "choose"):
        forced = None if choice == "choose" else GradSync.parse(choice)
        forced_prepared = dataclasses.replace(prepared, options=dataclasses.replace(base, grad_sync=forced))
        started = time.perf_counter()
        try:
            plan = plan_prepared(forced_prepared, "auto")
        except AutoplanError as error:
            rows.append([f"{cluster_name} × {nodes}", choice, "—", "—", str(error).split(":")[0], "—"])
            continue
        step = plan.estimate.step_time_s
        exact_s = step if choice == "exact" else exact_s
        versus = f"{exact_s / step:.2f}×" if exact_s else "—"
        label = plan.grad_sync.label if choice == "choose" else choice
        rows.append(
            [
                f"{cluster_name} × {nodes}",
                "auto --allow-lossy → " + label if choice == "choose" else choice,
                f"{step:.4g}",
                versus,
                plan_shape(plan),
                f"{time.perf_counter() - started:.0f}",
            ]
        )
        print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.grad_sync", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clusters", default="p3.16xlarge:4,dgx-a100:8", help="NAME:NODES,... (default %(default)s)")
    parser.add_argument("--batch", type=int, default=128, help="global batch (default %(default)s)")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/grad_sync-<date>.md")
    args = parser.parse_args()
    rows = []
    for item in args.clusters.split(","):
        name, _, nodes = item.partition(":")
        rows += rows_for(name, int(nodes or 1), batch=args.batch)
    header = ["cluster", "gradient sync", "step (s)", "speedup vs exact", "plan", "planning (s)"]
    table = "\n".join(
        ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(row) + " |" for row in rows)]
    )
    print(table)
    if args.save:
        command = "python -m benchmarks.grad_sync " + " ".join(sys.argv[1:])
        description = (
            f"GPT-1.3B (`examples/gpt.py --model-arg size=1.3b`), batch {args.batch}, adam-mixed, roofline costs. "
            "Each row is `auto` with `--allow-lossy --grad-sync CHOICE` (every candidate forced to that sync; a "
            "choice no fitting candidate can run shows why), the last row per cluster `auto --allow-lossy` free to "
            "choose. Estimated steps in the cost model (planner.costing.compression: compressed bytes, PowerSGD's "
            "three all-reduces per bucket and its compute, local SGD's amortised parameter average), not measured. "
            "PowerSGD and local SGD start after 10 exact warm-up steps; the table is the steady state."
        )
        save_table(
            "grad_sync",
            title="Gradient sync choices: exact, bf16, PowerSGD, local SGD",
            command=command,
            description=description,
            table=table,
        )


if __name__ == "__main__":
    main()
