"""Regret, held out: does auto pick the plan that runs fastest here, and does ``plan tune``?

For each world size W (2 and 4 local gloo processes, one thread each) this benchmark does what a user does:

1. **Calibrate** as ``plan --cluster local-cpu`` does by default (``plan calibrate --quick`` for W processes:
   :func:`calibration.machine.calibrate_machine`), in a fresh cache; no cluster file from an earlier run is read.
2. **Plan** each held-out case (:data:`heldout_cases.SCORED`: none is a calibration probe, none is a development
   case) with ``auto`` and take every distinct candidate auto priced (:func:`planner.tuning.candidate_names`:
   auto's pick, the data-parallel, Megatron and uniform-pipeline plans, the stage DP's and rescheduled ones).
3. **Run every candidate twice** with the training program's step (:func:`planner.cli.tune.measure_locally`:
   ``--warmup`` steps, then the median of ``--steps``): run A over all candidates, then run B over all.
   **Run A is ``plan tune``'s**: tune keeps, among its first ``--candidates`` candidates (its default 4), the
   measured fastest that fits, by run A alone (:func:`planner.tuning.choose`). **Run B scores**: regret is
   measured(pick) ÷ measured(fastest candidate), both from run B, so tune's choice is scored on timings it never
   saw and is not 1 by construction. The rule (A chooses, B scores) was fixed before any run and reads no
   estimate.

Per world: regret of auto's pick and of tune's pick on every case (targets: without tuning ≤ 1.10 on every case and
median ≤ 1.03; with tuning ≤ 1.02 on every case), Spearman's ρ of estimate against measured (run B) over all
candidates of the world (target ≥ 0.9), MAPE (target ≤ 15%), and peak memory per rank against the estimate.

    python -m benchmarks.regret [--worlds 2 4] [--cases gpt,bert,...] [--steps 10] [--warmup 3] [--save]

``--save`` writes ``benchmarks/results/regret-DATE.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.fidelity_sets import spearman
from benchmarks.heldout_cases import SCORED, check_scored_disjoint
from benchmarks.regret_report import page
from benchmarks.results_page import save_table

TUNE_CANDIDATES = 4  # plan tune's default
ALL_CANDIDATES = 8  # every distinct candidate auto priced (there are at most 5 or 6)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def calibrate(world: int) -> tuple[object, dict]:
    """This machine calibrated for ``world`` processes as ``plan`` does by default."""
    from calibration.machine import calibrate_machine
    from cost_models.cluster import Cluster

    result = calibrate_machine(num_processes=world, quick=True, progress=lambda message: None, probe_steps=3)
    data = result.to_json()
    cluster = Cluster.from_json(data, source="regret calibration")
    return replace(cluster, name="local-cpu"), data


def measure(path: Path, *, steps: int, warmup: int) -> dict:
    from planner.cli.tune import measure_locally

    started = time.perf_counter()
    result, error = measure_locally(path, steps=steps, warmup=warmup, timeout_s=900)
    if result is None:
        return {"error": error, "wall_s": time.perf_counter() - started}
    return {
        "median_s": result["median_s"],
        "peak_bytes": result["peak_bytes"],
        "step_times_s": result["step_times_s"],
        "steal": result["steal"],
        "foreign": result["foreign"],
        "wall_s": time.perf_counter() - started,
    }


def run_case(name: str, cluster, directory: Path, *, steps: int, warmup: int) -> dict:
    """Plan one case, run each of its candidates in runs A and B; the plans' figures and the timings."""
    from planner.api import candidate_plan, prepare_model_file
    from planner.methods import search_auto
    from planner.plan import save_plan
    from planner.plan.shape import plan_shape
    from planner.tuning import candidate_names

    case = SCORED[name]
    started = time.perf_counter()
    prepared = prepare_model_file(case.path, cluster, batch_size=case.batch, model_args=dict(case.args))
    search = search_auto(prepared)
    result = search.result
    names = candidate_names(result, count=ALL_CANDIDATES)
    candidates = {}
    for candidate in names:
        plan = candidate_plan(prepared, candidate, search=search)
        path = directory / f"{name}-{candidate}.json"
        save_plan(plan, path)
        candidates[candidate] = {
            "path": path,
            "shape": plan_shape(plan),
            "estimate_s": plan.estimate.step_time_s,
            "memory_bytes": plan.estimate.memory_per_device_bytes,
            "budget_bytes": plan.memory_budget_bytes,
        }
    plan_s = time.perf_counter() - started
    for run in ("A", "B"):
        for candidate, row in candidates.items():
            row[run] = measure(row["path"], steps=steps, warmup=warmup)
            shown = row[run].get("median_s")
            _say(
                f"  {name} {candidate} run {run}: "
                + (f"{shown * 1e3:.1f} ms (estimate {row['estimate_s'] * 1e3:.1f} ms)" if shown else row[run]["error"])
            )
    for row in candidates.values():
        row["path"] = str(row["path"])
    return {
        "case": name,
        "auto": result.chosen_by,
        "order": names,
        "tune_candidates": names[:TUNE_CANDIDATES],
        "candidates": candidates,
        "plan_s": plan_s,
    }


def _fits(row: dict, run: str) -> bool:
    measured = row[run]
    return "median_s" in measured and max(measured["peak_bytes"]) <= row["budget_bytes"]


def score_case(case: dict) -> dict:
    """Tune's pick by run A, the fastest and the regrets by run B (module docstring)."""
    rows = case["candidates"]
    usable_a = [name for name in case["tune_candidates"] if _fits(rows[name], "A")]
    tune_pick = min(usable_a, key=lambda name: rows[name]["A"]["median_s"]) if usable_a else None
    measured_b = {name: row["B"]["median_s"] for name, row in rows.items() if _fits(row, "B")}
    best = min(measured_b.values()) if measured_b else None
    auto = case["auto"]

    def regret(name: str | None) -> float | None:
        return measured_b[name] / best if name in measured_b and best else None

    return {
        "tune_pick": tune_pick,
        "fastest": min(measured_b, key=measured_b.get) if measured_b else None,
        "auto_regret": regret(auto),
        "tune_regret": regret(tune_pick),
    }


def world_scores(cases: list[dict]) -> dict:
    """Spearman and MAPE of estimate against run B over every candidate of a world; memory errors."""
    estimates, measured, memory = [], [], []
    for case in cases:
        for row in case["candidates"].values():
            if "median_s" in row["B"]:
                estimates.append(row["estimate_s"])
                measured.append(row["B"]["median_s"])
                memory.append(max(row["B"]["peak_bytes"]) / row["memory_bytes"] - 1 if row["memory_bytes"] else 0.0)
    errors = [e / m - 1 for e, m in zip(estimates, measured, strict=True)]
    regrets = [case["score"]["auto_regret"] for case in cases if case["score"]["auto_regret"]]
    tuned = [case["score"]["tune_regret"] for case in cases if case["score"]["tune_regret"]]
    return {
        "spearman": spearman(estimates, measured) if len(estimates) > 1 else None,
        "mape": statistics.fmean(abs(e) for e in errors) if errors else None,
        "rows": len(errors),
        "auto_regret_max": max(regrets, default=None),
        "auto_regret_median": statistics.median(regrets) if regrets else None,
        "tune_regret_max": max(tuned, default=None),
        "memory_error_mean": statistics.fmean(abs(e) for e in memory) if memory else None,
        "memory_under_10": sum(e < -0.10 for e in memory),
        "memory_within_15": sum(abs(e) <= 0.15 for e in memory),
    }


def run_worlds(args: argparse.Namespace) -> dict:
    """Every world of ``args``: calibrate, plan and run each case; the raw results (written after every case)."""
    names = args.cases.split(",")
    os.environ["AUTOPLAN_CACHE_DIR"] = tempfile.mkdtemp(prefix="autoplan-regret-cache-")
    started = time.perf_counter()
    result: dict = {"worlds": [], "steps": args.steps, "warmup": args.warmup, "wall_s": 0.0}
    for world in args.worlds:
        _say(f"world {world}: calibrating (plan calibrate --quick) ...")
        cluster, calibration = calibrate(world)
        cases: list[dict] = []
        entry = {"world": world, "calibration": calibration.get("calibration", {}), "cases": cases, "scores": {}}
        result["worlds"].append(entry)
        with tempfile.TemporaryDirectory(prefix=f"regret-w{world}-") as directory:
            for name in names:
                _say(f"world {world}: {name}")
                try:
                    case = run_case(name, cluster, Path(directory), steps=args.steps, warmup=args.warmup)
                except Exception as error:  # a case that cannot be planned is reported, the others still run
                    entry.setdefault("failed", []).append({"case": name, "error": f"{type(error).__name__}: {error}"})
                    _say(f"  {name} failed: {error}")
                    continue
                case["score"] = score_case(case)
                cases.append(case)
                entry["scores"] = world_scores(cases)
                result["wall_s"] = time.perf_counter() - started
                if args.json_out:
                    Path(args.json_out).write_text(json.dumps(result, indent=2))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.regret", description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--cases", default=",".join(SCORED), help="comma-separated keys of heldout_cases.SCORED")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--json-out", default=None, help="also write the raw results here (after every case)")
    parser.add_argument(
        "--from-json", nargs="+", default=None, help="draw the page from raw results of earlier runs (their worlds)"
    )
    args = parser.parse_args()
    check_scored_disjoint()
    if args.from_json:
        runs = [json.loads(Path(path).read_text()) for path in args.from_json]
        result = {
            "worlds": [world for run in runs for world in run["worlds"]],
            "steps": runs[0]["steps"],
            "warmup": runs[0]["warmup"],
            "wall_s": sum(run["wall_s"] for run in runs),
        }
    else:
        result = run_worlds(args)
    title, description, table = page(result)
    print(description + "\n\n" + table)
    if args.save:
        command = "python -m benchmarks.regret " + " ".join(sys.argv[1:])
        path = save_table("regret", title=title, command=command, description=description, table=table)
        path.with_suffix(".json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
