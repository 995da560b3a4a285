"""Estimated against measured peak memory per rank, on the held-out cases of ``benchmarks/heldout_cases.py``.

For each world size W (2 and 4 local gloo processes) every case of the chosen set is planned on ``local-cpu``
with W devices (``plan MODEL --cluster local-cpu --devices-per-node W --optimizer sgd``, roofline costs) under
the families a user would run (:data:`FAMILIES`): data parallel as planned (DDP or FSDP), data parallel with
``--zero 3`` (FSDP), Megatron tensor parallel (``--degrees W,1,1``), a Megatron 1F1B pipeline
(``--degrees 1,2,W/2 --microbatches 4``), auto, and on a few cases (:data:`HASH_CASES`) the ``hash`` op
placement. A plan the planner refuses is reported as refused, with its reason. Then one torchrun job per world
measures every plan's peak per rank
(:mod:`executors.measure.memory_peak`: the CPU allocator's count of live bytes over one profiled SGD step
after 2 warm-up steps, plus the parameters the runner trains in place), and the job runs ``--attempts``
times (default 2): allocation counts of a fixed program are deterministic, so the attempts must agree;
any difference is reported.

Per plan: the estimate (``Plan.estimate.memory_per_device_bytes``, the fullest device's figure, what
decides whether a plan fits) against the fullest rank's measured peak; per rank: the simulator's
per-device peak against that rank's. Summary: mean absolute error, rows within ±15%, rows more than
10% under (an under-estimate is an out-of-memory crash; targets: every row within ±15%, none more
than 10% under).

    python -m benchmarks.memory [--set development|scored] [--worlds 2 4] [--only CASE ...]
                                [--families dp fsdp tp pipe auto hash] [--attempts 2] [--save] [--json-out F]

``--save`` writes ``benchmarks/results/memory-DATE.md`` (page; the set's name in the file name when it is
not ``scored``) and ``.json`` (rows).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.heldout_cases import DEVELOPMENT, SCORED, ModelCase, check_scored_disjoint
from benchmarks.memory_report import describe, rows_table, summary_table
from benchmarks.results_page import RESULTS, save_table
from planner.errors import AutoplanError

WARMUP_STEPS = 2


def family_options(family: str, world: int) -> tuple[str, dict[str, object]]:
    """The method and planner options of a plan family at ``world`` devices."""
    if family == "dp":
        return "data-parallel", {}
    if family == "fsdp":
        return "data-parallel", {"zero": "3"}
    if family == "tp":
        return "megatron", {"degrees": (world, 1, 1)}
    if family == "pipe":
        return "megatron", {"degrees": (1, 2, world // 2), "schedule": "1f1b", "microbatches": 4}
    if family == "auto":
        return "auto", {}
    assert family == "hash", family
    return "hash", {}


FAMILIES = ("dp", "fsdp", "tp", "pipe", "auto", "hash")
HASH_CASES = {"development": ("gru", "mlp"), "scored": ("lstm", "gpt")}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def plan_case(name: str, case: ModelCase, family: str, world: int, directory: Path) -> dict:
    """Plan one case under one family; its row (estimate, simulated per rank), or the refusal."""
    from cost_models.cluster import preset
    from planner.api import plan_prepared, prepare_model_file
    from planner.costing.lowering import simulate_plan
    from planner.errors import AutoplanError
    from planner.plan import save_plan

    method, options = family_options(family, world)
    row: dict = {
        "case": name,
        "family": family,
        "world": world,
        "method": method,
        "options": {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()},
    }
    cluster = preset("local-cpu").with_shape(num_nodes=1, devices_per_node=world)
    started = time.perf_counter()
    try:
        prepared = prepare_model_file(
            case.path,
            cluster,
            batch_size=case.batch,
            model_args=dict(case.args),
            optimizer="sgd",
            cost_model="roofline",
            **options,
        )
        plan = plan_prepared(prepared, method)
    except AutoplanError as error:
        log(f"  {name}-{family}@{world}: refused: {error}")
        return {**row, "refused": str(error)}
    graph = prepared.graphs.at(case.batch // plan.num_microbatches)
    simulation = simulate_plan(plan, graph, prepared.setup)
    path = directory / f"{name}-{family}-w{world}.json"
    save_plan(plan, path)
    log(
        f"  planned {name}-{family}@{world}: {len(plan.stages)} stage(s), estimate "
        f"{plan.estimate.memory_per_device_bytes / 2**20:.1f} MiB ({time.perf_counter() - started:.1f} s)"
    )
    return {
        **row,
        "path": str(path),
        "stages": len(plan.stages),
        "schedule": plan.schedule,
        "microbatches": plan.num_microbatches,
        "estimate_bytes": plan.estimate.memory_per_device_bytes,
        "simulated_bytes": [float(b) for b in simulation.peak_memory_bytes],
    }


def measure(world: int, rows: list[dict], *, attempts: int, directory: Path) -> None:
    """Every planned row's peak per rank, ``attempts`` torchrun jobs (one per attempt, all plans in each); a job
    that fails as a whole (ranks that fail apart leave the others waiting in a collective) is run again plan by
    plan, and a plan that fails alone is reported as failed."""
    planned = [row for row in rows if "path" in row]
    for attempt in range(1, attempts + 1):
        started = time.perf_counter()
        paths = [row["path"] for row in planned]
        try:
            peaks, parts = _job(paths, world=world, out=directory / f"memory-w{world}-{attempt}.json")
        except AutoplanError as error:
            log(f"world {world} attempt {attempt}: the job failed ({error}); measuring plan by plan")
            peaks, parts = {}, {}
            for k, path in enumerate(paths):
                try:
                    found = _job([path], world=world, out=directory / f"memory-w{world}-{attempt}-{k}.json")
                except AutoplanError as alone:
                    found = ({path: [None] * world}, {path: [{"error": str(alone)}] * world})
                peaks.update(found[0])
                parts.update(found[1])
        for row in planned:
            failed = [part["error"] for part in parts[row["path"]] if "error" in part]
            if failed:
                row["failed"] = failed[0]
                continue
            row.setdefault("measured_bytes", []).append([int(b) for b in peaks[row["path"]]])
            row.setdefault("parts", []).append(parts[row["path"]])
        log(f"world {world} attempt {attempt}: {len(planned)} plans measured in {time.perf_counter() - started:.0f} s")


def _job(paths: list[str], *, world: int, out: Path) -> tuple[dict, dict]:
    """One torchrun job of :mod:`executors.measure.memory_peak`: peaks and parts per plan."""
    from executors.measure.step_timing import run_timing

    peaks = run_timing(
        paths,
        world=world,
        steps=WARMUP_STEPS,
        out=out,
        module="executors.measure.memory_peak",
        timeout_s=600.0 * len(paths),
    )
    return peaks, json.loads(Path(f"{out}.parts.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=("development", "scored"), default="development", dest="which")
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4], choices=[2, 4])
    parser.add_argument("--only", nargs="+", help="only these cases of the set")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--attempts", type=int, default=2, help="measuring jobs per world, all reported (default 2)")
    parser.add_argument("--save", action="store_true", help="write the page and rows to benchmarks/results/")
    parser.add_argument("--json-out", type=Path, metavar="FILE.json", help="also write the rows here")
    args = parser.parse_args()
    check_scored_disjoint()
    cases = SCORED if args.which == "scored" else DEVELOPMENT
    unknown = sorted(set(args.only or ()) - set(cases))
    if unknown:
        parser.error(f"not in the {args.which} set: {', '.join(unknown)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started, rows = time.time(), []
    with tempfile.TemporaryDirectory(prefix="autoplan-memory-") as folder:
        directory = Path(folder)
        for world in args.worlds:
            log(f"world {world}: planning")
            world_rows = [
                plan_case(name, case, family, world, directory)
                for name, case in cases.items()
                if not args.only or name in args.only
                for family in args.families
                if family != "hash" or name in HASH_CASES[args.which]
            ]
            measure(world, world_rows, attempts=args.attempts, directory=directory)
            rows += world_rows
            if args.json_out:  # what is measured so far, should a later world fail
                args.json_out.write_text(json.dumps(rows, indent=1) + "\n")
    minutes = (time.time() - started) / 60
    body = summary_table(rows) + "\n\n" + rows_table(rows)
    head = describe(args.which, cases, minutes=minutes)
    print(head + "\n\n" + body)
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1) + "\n")
    if args.save:
        name = "memory" if args.which == "scored" else f"memory-{args.which}"
        command = " ".join(["python -m benchmarks.memory", *sys.argv[1:]])
        save_table(
            name,
            title=f"Estimated against measured peak memory per rank ({args.which} set)",
            command=command,
            description=head,
            table=body,
        )
        (RESULTS / f"{name}-{time.strftime('%Y-%m-%d')}.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
