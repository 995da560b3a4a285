"""Golden estimates: every deterministic method's estimate and simulated step on fixed cases, to compare.

For the README example (GPT-350M, batch 32, two p3.16xlarge nodes) and every case of
``benchmarks/quality.py``, each method of :data:`METHODS` (every one of ``plan compare`` except
``rl``, whose plan depends on its wall-clock budget) plans on one prepared model (roofline costs);
per plan it records the estimate (step seconds, memory per device), the simulated step and peak
memory (:func:`planner.costing.lowering.simulate_plan`), the plan's shape and a digest of every
node's output spec. Each case runs in its own process. Nothing is timed: the figures are exact and
repeatable, so a refactor that must not change behaviour is checked by comparing two files exactly.

    python -m benchmarks.estimates [--cases readme,mlp@a100x8,...] [--save] [--compare OLD.json]

``--save`` writes ``benchmarks/results/estimates-<date>.json`` and a markdown page beside it;
``--compare OLD.json`` prints every row whose estimate, simulated step, simulated memory, shape or
output specs differ from ``OLD.json`` (and exits 1 if an estimate or a simulated step does).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.quality_cases import CASES, parse_case
from benchmarks.results_page import RESULTS, save_table

ROOT = Path(__file__).resolve().parent.parent

METHODS = ("auto", "megatron", "uniform-pipeline", "data-parallel", "hash", "critical-path", "multi-objective", "m-etf")
README_CASE = "readme"


def worker(case: str) -> dict[str, dict]:
    from cost_models.cluster import load_cluster
    from planner.api import plan_prepared, prepare_model_file
    from planner.costing.lowering import simulate_plan
    from planner.errors import AutoplanError

    if case == README_CASE:
        example, args, batch, cluster = "gpt", {"size": "350m"}, 32, load_cluster("p3.16xlarge", num_nodes=2)
    else:
        example, args, batch, name, nodes = parse_case(case)
        cluster = load_cluster(name, num_nodes=nodes, devices_per_node=8)
    prepared = prepare_model_file(ROOT / "examples" / f"{example}.py", cluster, batch_size=batch, model_args=args)
    rows: dict[str, dict] = {}
    for method in METHODS:
        try:
            plan = plan_prepared(prepared, method)
        except AutoplanError as error:
            rows[method] = {"error": str(error)}
            continue
        graph = prepared.graphs.at(plan.batch_size // plan.num_microbatches)
        simulated = simulate_plan(plan, graph, prepared.setup)
        rows[method] = {
            "estimate_s": plan.estimate.step_time_s,
            "memory": plan.estimate.memory_per_device_bytes,
            "sim_s": simulated.step_time_s,
            "sim_mem": simulated.max_memory_bytes,
            "shape": [[list(stage.mesh_shape), len(stage.nodes)] for stage in plan.stages],
            "m": plan.num_microbatches,
            "schedule": plan.schedule,
            "outputs_sha256": specs_digest(
                {n: list(spec) for stage in plan.stages for n, spec in stage.output_specs.items()}
            ),
        }
    return rows


def specs_digest(specs: dict[str, list[str]]) -> str:
    """A short digest of every node's output spec: equal digests, equal specs (the file stays small)."""
    return hashlib.sha256(json.dumps(specs, sort_keys=True).encode()).hexdigest()[:16]


def run(case: str) -> dict[str, dict]:
    command = [sys.executable, "-m", "benchmarks.estimates", "--worker", case]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def differences(old: dict, new: dict) -> tuple[list[str], int]:
    """One line per difference, and how many of them are estimates or simulated steps."""
    lines, serious = [], 0
    for case in sorted(set(old) | set(new)):
        for method in METHODS:
            a, b = old.get(case, {}).get(method), new.get(case, {}).get(method)
            if a is None or b is None or "error" in a or "error" in b:
                if a != b:
                    lines.append(f"{case} {method}: {a and a.get('error')} -> {b and b.get('error')}")
                    serious += 1
                continue
            for key in ("estimate_s", "sim_s", "memory", "sim_mem", "shape", "m", "schedule", "outputs_sha256"):
                if a[key] != b[key]:
                    serious += key in ("estimate_s", "sim_s")
                    change = (
                        f"{a[key]:.6g} -> {b[key]:.6g} ({b[key] / a[key] - 1:+.2%})"
                        if key.endswith(("_s", "mem", "memory"))
                        else "differ"
                    )
                    lines.append(f"{case} {method} {key}: {change}")
    return lines, serious


def table(results: dict) -> str:
    lines = ["| case | " + " | ".join(METHODS) + " |", "|---|" + "---:|" * len(METHODS)]
    for case, rows in results.items():
        cells = [f"{r['estimate_s']:.4g} / {r['sim_s']:.4g}" if "error" not in r else "—" for r in rows.values()]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.estimates", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--cases", default=",".join((README_CASE, *CASES)), help="comma-separated; default: all")
    parser.add_argument("--save", action="store_true", help="write the results to benchmarks/results/")
    parser.add_argument("--compare", metavar="OLD.json", help="print every difference from an earlier file")
    options = parser.parse_args()
    if options.worker:
        print(json.dumps(worker(options.worker)))
        return
    results = {}
    for case in options.cases.split(","):
        print(f"{case} ...", file=sys.stderr, flush=True)
        results[case] = run(case)
    print(table(results))
    if options.save:
        path = RESULTS / f"estimates-{datetime.date.today().isoformat()}.json"
        path.write_text(json.dumps(results, indent=1) + "\n")
        save_table(
            "estimates",
            title="Golden estimates: estimate / simulated step per method",
            command="python -m benchmarks.estimates " + " ".join(sys.argv[1:]),
            description=f"Seconds per step, estimate / simulated (roofline). Every figure: `{path.name}`.",
            table=table(results),
        )
    if options.compare:
        lines, serious = differences(json.loads(Path(options.compare).read_text()), results)
        rows = sum(len(r) for r in results.values())
        print(
            f"\n{rows} method×case rows against {options.compare}: {len(lines)} difference(s), {serious} in an "
            "estimate or a simulated step"
        )
        print("\n".join(lines))
        if serious:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
