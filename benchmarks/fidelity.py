"""Held-out cost-model fidelity: predicted against measured step time and peak memory, on this machine.

For each world size N (2 and 4 local gloo processes, one thread each), in one run:

1. **Calibrate now** (:func:`calibration.machine.calibrate_machine`, what ``plan calibrate
   --processes N`` does): matmul, memory and gloo collectives measured with N processes running, the
   executors' host overheads and the compute contention (``compute_extra``) fitted under the profiled
   cost model on the *probe set* (:mod:`fidelity_sets`; each probe timed twice, its least disturbed
   timing kept). Every timing run first waits (up to 60 s) for other processes to take at most 25%
   of the CPU (:func:`wait_for_quiet`). No cluster file from
   an earlier run is read; operator profiles go to a fresh cache (``$AUTOPLAN_CACHE_DIR`` in a
   temporary folder), so they too are measured in this run.
2. **Plan the scored set** (held out: no scored model is a probe model) on that cluster with
   ``--cost-model`` (default ``profiled``), SGD; keep the plan's estimate and the simulator's replay.
3. **Time** every plan with our executors (:func:`executors.measure.step_timing.run_timing`: 3 warm-up
   steps, median of ``--steps`` steps, slowest rank), ``--attempts`` times; per plan the job records
   the host's steal and other processes' CPU share while it was timed, and
   :func:`fidelity_sets.keep` keeps per plan the least disturbed timing: it reads only those shares,
   never the error.
4. **Memory**: every rank's peak over one profiled step (:mod:`executors.measure.memory_peak`: the CPU
   allocator's count at its most) against the estimate's memory per device and the simulator's per-device peak
   (``benchmarks/memory.py`` scores memory alone, on more plans).

Per world: MAPE, worst row, rows within 20%, Spearman (:func:`fidelity_sets.world_summary`).

    python -m benchmarks.fidelity [--save] [--worlds 2 4] [--only CASE ...] [--attempts 2] [--steps 10]
                                  [--probe-steps 10] [--cost-model profiled|roofline] [--no-memory]
    python -m benchmarks.fidelity --draw-from benchmarks/results/fidelity-DATE.json   (redraw the figure only)

``--save`` writes ``benchmarks/results/fidelity-DATE.md`` (page), ``.json`` (rows), ``.png`` (figure) and
the two calibrated cluster files ``fidelity-DATE-cluster-w{2,4}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.fidelity_report import (
    DESCRIPTION,
    attempts_table,
    calibration_text,
    draw,
    memory_table,
    rows_table,
    sets_text,
    summary_table,
)
from benchmarks.fidelity_sets import SCORED, Attempt, Timing, check_disjoint, keep
from benchmarks.results_page import RESULTS, save_table

QUIET_SHARE = 0.25  # start an attempt once others take at most this share of the CPU (3 s window)...
QUIET_WAIT_S = 60.0  # ...or after this long


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def calibrate(world: int, *, probe_steps: int, directory: Path, cost_model: str) -> tuple[Path, dict]:
    """Calibrate ``world`` processes now; the cluster file's path and its fitted figures."""
    from calibration.machine import calibrate_machine
    from calibration.measure import write_cluster_file

    share = wait_for_quiet(max_share=QUIET_SHARE, timeout_s=QUIET_WAIT_S)
    log(
        f"world {world}: calibrating (raw machine, then {probe_steps}-step runtime probes); others took "
        f"{share:.0%} of the CPU just before"
    )
    result = calibrate_machine(
        num_processes=world,
        probe_steps=probe_steps,
        progress=lambda m: log(f"  {m}"),
        cost_model=cost_model,
        probe_attempts=2,
    )
    path = write_cluster_file(result, directory / f"cluster-w{world}.json")
    cluster = result.to_cluster()
    figures = {
        "peak_gflops": result.matmul.peak_flops / 1e9,
        "memory_gbs": result.memory_bandwidth / 1e9,
        "shared_slowdown": result.shared_slowdown,
        "latency_us": cluster.intra_node.latency_s * 1e6,
        "bandwidth_gbs": cluster.intra_node.bandwidth / 1e9,
        "runtime": dict(result.runtime.values) if result.runtime else {},
        "probes": [(r.name, r.measured_s, result.runtime.predicted_s(r)) for r in result.runtime.rows]
        if result.runtime
        else [],
    }
    return path, figures


def make_plans(cluster_path: Path, world: int, directory: Path, *, cost_model: str, only: list[str] | None) -> dict:
    """Plan every scored case on the calibrated cluster; the rows without measurements yet."""
    from cost_models.cluster import load_cluster
    from cost_models.compute import RooflineCompute
    from planner.api import plan_prepared, prepare_model_file
    from planner.costing.lowering import simulate_plan
    from planner.plan import save_plan

    cluster = load_cluster(str(cluster_path), num_nodes=1, devices_per_node=world)
    rows = {}
    for name, case in SCORED.items():
        if only and name not in only:
            continue
        started = time.perf_counter()
        prepared = prepare_model_file(
            case.path,
            cluster,
            batch_size=case.batch,
            model_args=dict(case.args),
            optimizer="sgd",
            cost_model=cost_model,
            **case.planner_options(world),
        )
        plan = plan_prepared(prepared, case.method)
        graph = prepared.graphs.at(case.batch // plan.num_microbatches)
        simulation = simulate_plan(plan, graph, prepared.setup)
        roofline = replace(prepared.setup, compute=RooflineCompute(device=cluster.device))
        path = directory / f"{name}-w{world}.json"
        save_plan(plan, path)
        rows[f"{name}@{world}"] = {
            "name": name,
            "path": str(path),
            "world": world,
            "method": case.method,
            "model": case.model,
            "estimate_s": plan.estimate.step_time_s,
            "simulated_s": simulation.step_time_s,
            "roofline_s": simulate_plan(plan, graph, roofline).step_time_s,
            "estimate_bytes": plan.estimate.memory_per_device_bytes,
            "simulated_bytes": [float(b) for b in simulation.peak_memory_bytes],
        }
        log(
            f"  planned {name}@{world}: estimate {plan.estimate.step_time_s * 1e3:.1f} ms "
            f"({time.perf_counter() - started:.1f} s)"
        )
    return rows


def wait_for_quiet(*, max_share: float, timeout_s: float, window_s: float = 3.0) -> float:
    """Wait (up to ``timeout_s``) until other processes and the host take at most ``max_share`` of the
    CPU over a ``window_s`` window; the last window's share. Blind to any estimate."""
    from executors.measure.step_timing import cpu_ticks

    deadline = time.monotonic() + timeout_s
    while True:
        before = cpu_ticks()
        time.sleep(window_s)
        after = cpu_ticks()
        share = (after[1] - before[1] + after[0] - before[0]) / max(after[2] - before[2], 1)
        if share <= max_share or time.monotonic() >= deadline:
            return share


def time_attempt(world: int, index: int, rows: dict, *, steps: int, directory: Path) -> Attempt:
    """One timing run of a world's plans; per plan, the host's steal and other processes' CPU share."""
    from executors.measure.step_timing import run_timing

    paths = {key: row["path"] for key, row in rows.items()}
    out = directory / f"measured-w{world}-{index}.json"
    waited = time.perf_counter()
    share = wait_for_quiet(max_share=QUIET_SHARE, timeout_s=QUIET_WAIT_S)
    log(
        f"world {world} attempt {index}: waited {time.perf_counter() - waited:.0f} s for a quiet machine "
        f"(others took {share:.0%} of the CPU in the last {3:.0f} s)"
    )
    load_before, started = os.getloadavg()[0], time.perf_counter()
    measured = run_timing(list(paths.values()), world=world, steps=steps, out=out)
    shares = json.loads(Path(f"{out}.machine.json").read_text())
    timings = {
        key: Timing(
            attempt=index,
            measured_s=measured[path],
            steal_share=shares[path]["steal"],
            foreign_share=shares[path]["foreign"],
        )
        for key, path in paths.items()
    }
    attempt = Attempt(
        world=world,
        index=index,
        timings=timings,
        load_before=load_before,
        load_after=os.getloadavg()[0],
        wall_s=time.perf_counter() - started,
    )
    worst = max(t.disturbance for t in timings.values())
    log(
        f"world {world} attempt {index}: load {load_before:.2f} -> {attempt.load_after:.2f}, "
        f"{attempt.wall_s:.0f} s, steal + other processes up to {worst:.0%} of the CPU"
    )
    return attempt


def measure_memory(world: int, rows: dict, *, directory: Path) -> None:
    from executors.measure.step_timing import run_timing

    log(f"world {world}: peak memory per rank, one profiled step per plan")
    paths = [row["path"] for row in rows.values()]
    peaks = run_timing(
        paths, world=world, steps=2, out=directory / f"memory-w{world}.json", module="executors.measure.memory_peak"
    )
    for row in rows.values():
        row["measured_bytes"] = [float(b or 0) for b in peaks[row["path"]]]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fidelity", description=__doc__.splitlines()[0])
    parser.add_argument("--save", action="store_true", help="write the page and figure to benchmarks/results/")
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4], choices=[2, 4])
    parser.add_argument("--only", nargs="+", choices=sorted(SCORED), help="score only these cases")
    parser.add_argument("--attempts", type=int, default=2, help="timing runs per world, all reported (default 2)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per plan (after 3 warm-up steps)")
    parser.add_argument("--probe-steps", type=int, default=10, help="timed steps per calibration probe")
    parser.add_argument("--cost-model", choices=("profiled", "roofline"), default="profiled")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    parser.add_argument("--draw-from", type=Path, metavar="FILE.json", help="only redraw the figure of saved rows")
    return parser


def main() -> None:
    args = _parser().parse_args()
    if args.draw_from:
        draw(json.loads(args.draw_from.read_text()), args.draw_from.with_suffix(".png"))
        return
    check_disjoint()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.time()
    rows: dict[str, dict] = {}
    attempts: list[Attempt] = []
    kept: dict[str, Timing] = {}
    calibrations: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="autoplan-fidelity-") as folder:
        directory = Path(folder)
        os.environ["AUTOPLAN_CACHE_DIR"] = str(directory / "profiles")  # operator times measured in this run
        for world in args.worlds:
            cluster_path, calibrations[world] = calibrate(
                world, probe_steps=args.probe_steps, directory=directory, cost_model=args.cost_model
            )
            planned = make_plans(cluster_path, world, directory, cost_model=args.cost_model, only=args.only)
            tries = [
                time_attempt(world, i + 1, planned, steps=args.steps, directory=directory) for i in range(args.attempts)
            ]
            attempts += tries
            kept.update(keep(tries))
            for key, row in planned.items():
                row["measured_s"], row["disturbance"] = kept[key].measured_s, kept[key].disturbance
            if not args.no_memory:
                measure_memory(world, planned, directory=directory)
            rows.update(planned)
            if args.save:
                (RESULTS / f"fidelity-{time.strftime('%Y-%m-%d')}-cluster-w{world}.json").write_text(
                    cluster_path.read_text()
                )
    minutes = (time.time() - started) / 60
    sections = [summary_table(rows), rows_table(rows), attempts_table(attempts, kept)]
    if not args.no_memory:
        sections.append(memory_table(rows))
    body = "\n\n".join(sections)
    head = f"{sets_text()}\n\n{calibration_text(calibrations)}\n\nWall time of the run: {minutes:.0f} min."
    print(head + "\n\n" + body)
    if args.save:
        command = " ".join(["python -m benchmarks.fidelity", *sys.argv[1:]])
        save_table(
            "fidelity",
            title="Held-out cost-model fidelity: predicted against measured step time and memory",
            command=command,
            description=DESCRIPTION + "\n\n" + head,
            table=body,
        )
        today = time.strftime("%Y-%m-%d")
        (RESULTS / f"fidelity-{today}.json").write_text(json.dumps(rows, indent=1) + "\n")
        draw(rows, RESULTS / f"fidelity-{today}.png")


if __name__ == "__main__":
    main()
