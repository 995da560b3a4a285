"""Size and speed of the intra-op ILP: one stage of GPT on 2-D logical meshes.

For each case prints ILP variables, constraints, problem build seconds (strategies, costs,
edges), ILP build and solve seconds, and the objective against the data-parallel and Megatron
incumbents (``-`` when that plan does not fit in memory). Cases (issue 3): GPT 1.3b and 6.7b on
8 GPUs, 39b on 64 GPUs (dgx-a100), and 39b with 24 and 48 layers to show the time does not grow
with identical layers. Target on a 2-core machine: 39b in at most 10 s per mesh.

    python -m benchmarks.intra_op [--save]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks.results_page import save_table

ROOT = Path(__file__).resolve().parent.parent

CASES = [
    ("1.3b", {}, 1, 16),
    ("6.7b", {}, 1, 16),
    ("39b", {}, 8, 64),
    ("39b", {"layers": 24}, 8, 64),
]


def run_case(size: str, overrides: dict, num_nodes: int, batch_size: int) -> list[dict]:
    from cost_models.cluster import load_cluster
    from cost_models.compute import RooflineCompute
    from planner.costing.setup import CostSetup
    from planner.intra.logical_meshes import logical_meshes
    from planner.intra.problem import MemoryBudgetError
    from planner.intra.solve import solve_intra_op
    from planner.ir.capture import capture
    from planner.ir.model_file import instantiate, load_model_file
    from planner.sharding.specs import StageMesh

    cluster = load_cluster("dgx-a100", num_nodes=num_nodes)
    setup = CostSetup(cluster=cluster, compute=RooflineCompute(device=cluster.device), optimizer="adam-mixed")
    model, inputs = instantiate(
        load_model_file(ROOT / "examples" / "gpt.py"), batch_size=batch_size, model_args={"size": size, **overrides}
    )
    graph = capture(model, inputs)
    rows = []
    for shape in logical_meshes(cluster.num_devices, cluster.devices_per_node)[1:]:
        mesh = StageMesh(
            cluster=cluster, devices=tuple(range(cluster.num_devices)), mesh_shape=shape, activation_itemsize=2
        )
        started = time.perf_counter()
        try:
            result = solve_intra_op(graph, setup, mesh)
        except MemoryBudgetError:
            rows.append(
                {
                    "case": f"{size}, {overrides.get('layers', model.cfg.layers)} layers",
                    "mesh": shape,
                    "fits": False,
                    "total_s": time.perf_counter() - started,
                }
            )
            continue
        total = time.perf_counter() - started
        case = f"{size}, {overrides.get('layers', model.cfg.layers)} layers, {len(graph)} operators"
        rows.append(
            _solved_row(result, case=case, devices=cluster.num_devices, shape=shape, total_s=total, setup=setup)
        )
    return rows


def _solved_row(result, *, case: str, devices: int, shape: tuple[int, ...], total_s: float, setup) -> dict:
    """One mesh's row: the ILP's size and times, its objective, and the data-parallel and Megatron incumbents'
    objectives on the same problem ("-" where they do not fit the memory budget)."""
    from planner.intra.incumbents import data_parallel_choice, megatron_choice
    from planner.intra.problem import evaluate

    problem = result.stage.problem

    def incumbent(choice: tuple[int, ...]) -> str:
        objective, memory = evaluate(problem, choice)
        return f"{objective:.3f}" if memory <= setup.memory_budget_bytes else "-"

    return {
        "case": case,
        "devices": devices,
        "mesh": shape,
        "fits": True,
        "ilp_vars": result.solution.num_variables,
        "constraints": result.solution.num_constraints,
        "problem_s": result.build_s,
        "ilp_build_s": result.solution.build_s,
        "solve_s": result.solution.solve_s,
        "total_s": total_s,
        "objective_s": result.objective_s,
        "data_parallel_s": incumbent(data_parallel_choice(result.stage)),
        "megatron_s": incumbent(megatron_choice(result.stage)),
        "optimal": result.solution.optimal,
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| GPT | devices | mesh | ILP vars | constraints | problem s | ILP build s | solve s | total s | step s (ILP) "
        "| DP s | Megatron s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mesh = "×".join(map(str, r["mesh"]))
        if not r["fits"]:
            lines.append(f"| {r['case']} | | {mesh} | no sharding fits | | | | | {r['total_s']:.2f} | | | |")
            continue
        lines.append(
            f"| {r['case']} | {r['devices']} | {mesh} | {r['ilp_vars']:,} | {r['constraints']:,} | "
            f"{r['problem_s']:.2f} | "
            f"{r['ilp_build_s']:.2f} | {r['solve_s']:.2f} | {r['total_s']:.2f} | {r['objective_s']:.3f}"
            f"{'' if r['optimal'] else '*'} | {r['data_parallel_s']} | {r['megatron_s']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.intra_op", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--save", action="store_true", help="write the table to benchmarks/results/")
    options = parser.parse_args()
    rows = []
    for size, overrides, nodes, batch in CASES:
        rows.extend(run_case(size, overrides, nodes, batch))
        print(f"done {size} {overrides}", file=sys.stderr)
    text = table(rows)
    print(text)
    if options.save:
        save_table(
            "intra_op",
            title="Intra-op ILP benchmark",
            command="python -m benchmarks.intra_op --save",
            description="One stage of GPT (examples/gpt.py, seq 1024, batch 16 on 8 GPUs, 64 on 64 GPUs) on dgx-a100 "
            "nodes, every 2-D logical mesh; roofline costs, mixed-precision Adam, 80 GiB budget. `problem s` = "
            "strategies, costs and edges; `total s` includes the data-parallel and Megatron incumbents. `*` = time "
            "limit hit. DP / Megatron: the same cost model's step time of those hand-written plans "
            "(`-` = does not fit).",
            table=text,
        )


if __name__ == "__main__":
    main()
