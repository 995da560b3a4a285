"""``plan tune MODEL_FILE --cluster ... --batch-size B``: plan, run the best candidates here, keep the measured fastest.

The decisions are :mod:`planner.tuning`'s (which candidates, which to keep, what to learn); this module runs them:
:func:`measure_locally` starts one torchrun job per candidate on this machine
(:mod:`executors.measure.measure_plan`: the training program's own step, ``--warmup`` steps then ``--steps`` timed,
each rank's peak memory), reports each as it finishes, skips one that fails or runs out of memory, and on
Ctrl-C stops the running job and writes nothing. At the end it writes the kept plan to ``--out``, the table of
every candidate's estimate against what it measured beside it (``OUT.tune.md`` and ``OUT.tune.json``), and —
unless ``--no-learn`` — the corrected figures into this machine's cached calibration of the cluster
(:mod:`calibration.store`), which the next ``plan`` on that cluster reads.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from cost_models.units import GIB
from planner.errors import AutoplanError

EXIT_INTERRUPTED = 130


def _parser() -> argparse.ArgumentParser:
    from planner.cli.options import UsageParser, add_cluster_options, add_model_options, add_search_options

    parser = UsageParser(
        prog="plan tune",
        description=(
            "Plan the model, then run its best distinct candidates on this machine — auto's pick, the best "
            "data-parallel, Megatron and uniform-pipeline plans, then auto's runners-up — each for --steps timed "
            "steps after --warmup, with the training program's own step; keep the measured fastest whose measured "
            "peak memory fits, write it as the plan with a table of estimated against measured for every "
            "candidate, and write what the measurements teach (a correction per cost component: compute, "
            "communication, host overhead, memory) into this machine's calibration of the cluster, so the next "
            "`plan` starts closer. A candidate that fails is reported and skipped; Ctrl-C writes nothing."
        ),
    )
    add_model_options(parser)
    add_cluster_options(parser, required=False)
    add_search_options(parser)
    parser.add_argument("--candidates", type=int, default=4, metavar="K", help="candidates to run (default 4)")
    parser.add_argument("--steps", type=int, default=10, metavar="N", help="timed steps per candidate (default 10)")
    parser.add_argument("--warmup", type=int, default=3, metavar="W", help="untimed steps first (default 3)")
    parser.add_argument(
        "--out", default="plan.json", help="the kept plan (default plan.json); the table goes beside it"
    )
    parser.add_argument("--no-learn", action="store_true", help="do not write corrections into the calibration")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: the plan's (gloo on CPU)")
    parser.add_argument("--timeout-s", type=float, default=600.0, metavar="S", help="seconds one candidate may take")
    return parser


def _check(options: argparse.Namespace) -> None:
    for flag, value, least in (
        ("--candidates", options.candidates, 1),
        ("--steps", options.steps, 1),
        ("--warmup", options.warmup, 0),
    ):
        if value < least:
            raise AutoplanError(f"{flag} must be at least {least}, got {value}")
    if options.timeout_s <= 0:
        raise AutoplanError(f"--timeout-s must be positive, got {options.timeout_s:g}")
    out = Path(options.out)
    if not out.parent.is_dir():
        raise AutoplanError(f"--out: directory {out.parent} does not exist")


def measure_locally(
    plan_path: Path, *, steps: int, warmup: int, backend: str | None = None, timeout_s: float = 600.0
) -> tuple[dict | None, str | None]:
    """Run :mod:`executors.measure.measure_plan` on the plan at ``plan_path`` with one process per device of the plan:
    ``(measurement, None)``, or ``(None, why it failed)``. Ctrl-C stops the job and is raised again."""
    from executors.measure.step_timing import root_cause
    from executors.training.launch import check_host, torchrun_argv
    from planner.plan import load_plan
    from planner.plan.launch import backend_for

    plan = load_plan(plan_path)
    chosen = backend or backend_for(plan.cluster)
    check_host(plan, backend=chosen)
    out = plan_path.with_suffix(".measured.json")
    command = torchrun_argv(
        world=plan.num_devices, module="executors.measure.measure_plan", args=[out, plan_path, steps, warmup, chosen]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        _, stderr = job.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop(job)
        return None, f"took over {timeout_s:g} s (--timeout-s)"
    except KeyboardInterrupt:
        _stop(job)
        raise
    if job.returncode or not out.is_file():
        return None, _failure(stderr, root_cause)
    return json.loads(out.read_text()), None


def _failure(stderr: str, root_cause) -> str:
    """The failing rank's one line (what the program's runtime prints), else the job's first error line."""
    named = [line for line in stderr.splitlines() if re.match(r"rank \d+( failed)?: ", line)]
    text = named[0] if named else root_cause(stderr)
    if "out of memory" in stderr.lower() or "MemoryError" in stderr:
        return f"out of memory: {text}"
    return text


def _stop(job: subprocess.Popen) -> None:
    """End the job's whole process group (torchrun and its ranks): SIGTERM, then SIGKILL."""
    for signal_number in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(job.pid, signal_number)
        except ProcessLookupError:
            break
        try:
            job.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue
    job.wait()


def run_tune(argv: Sequence[str]) -> int:
    from planner.api import tune_prepared
    from planner.cli.options import model_cluster, plan_options, prepare_from_options
    from planner.cli.tune_report import learn_into_calibration, print_rows, write_table
    from planner.plan import save_plan

    options = _parser().parse_args(list(argv))
    _check(options)
    chosen = plan_options(options)
    cluster = model_cluster(options)
    prepared = prepare_from_options(options, cluster=cluster, chosen=chosen)
    done: list[str] = []
    with tempfile.TemporaryDirectory(prefix="autoplan-tune-") as directory:
        measure = partial(_measure_candidate, options=options, directory=Path(directory), done=done)
        try:
            result = tune_prepared(prepared, measure=measure, candidates=options.candidates)
        except KeyboardInterrupt:
            say(f"interrupted after {len(done)} of {options.candidates} candidates: nothing written")
            return EXIT_INTERRUPTED
    out = Path(options.out)
    save_plan(result.plan, out)
    table = write_table(result, out, command=" ".join(["plan", "tune", *argv]))
    print(f"wrote {out} and {table}")
    print_rows(result)
    if not options.no_learn:
        print(learn_into_calibration(result, cluster))
    return 0


def _measure_candidate(name: str, plan, *, options: argparse.Namespace, directory: Path, done: list[str]):
    """Run candidate ``name`` here (:func:`measure_locally`), saying what it runs and what it measured; its
    :class:`planner.tuning.Measurement` (with the error of a failed run). ``done`` lists the candidates run."""
    from planner.plan import save_plan
    from planner.plan.shape import plan_shape
    from planner.tuning import Measurement

    index = len(done) + 1
    path = directory / f"{index}-{name}.json"
    save_plan(plan, path)
    say(
        f"[{index}/{options.candidates}] {name}: {plan_shape(plan)}; estimate "
        f"{plan.estimate.step_time_s * 1e3:.1f} ms, {plan.estimate.memory_per_device_bytes / GIB:.2f} GiB; "
        f"running {options.warmup} + {options.steps} steps ..."
    )
    result, error = measure_locally(
        path, steps=options.steps, warmup=options.warmup, backend=options.backend, timeout_s=options.timeout_s
    )
    done.append(name)
    if result is None:
        say(f"      {name} failed, skipped: {error}")
        return Measurement(step_time_s=None, error=error)
    peaks = tuple(float(p) for p in result["peak_bytes"])
    say(
        f"      measured {result['median_s'] * 1e3:.1f} ms a step "
        f"({result['median_s'] / plan.estimate.step_time_s:.2f}× the estimate), peak "
        f"{max(peaks) / GIB:.3f} GiB on the fullest rank"
    )
    return Measurement(
        step_time_s=float(result["median_s"]),
        peak_memory_bytes=peaks,
        disturbance=float(result.get("steal", 0.0)) + float(result.get("foreign", 0.0)),
    )


def say(message: str) -> None:
    sys.stderr.write(f"plan tune: {message}\n")
    sys.stderr.flush()
