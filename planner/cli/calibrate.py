"""``plan calibrate [--out FILE]``: measure this machine and write a cluster file.

:func:`calibrate_machine` measures the raw machine (processes, gloo collectives:
:mod:`executors.calibrate`; the fits: :mod:`cost_models.fitting.calibration`), then plans, runs and fits the
executor probes (:mod:`planner.cli.calibrate_runtime`) — the one step that needs both the planner
and the executors, which is why it lives here. The written file is accepted by ``--cluster FILE``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace

from cost_models.cluster import Cluster
from cost_models.fitting.calibration import CalibrationResult


def _parser() -> argparse.ArgumentParser:
    from planner.cli.options import UsageParser

    parser = UsageParser(
        prog="plan calibrate",
        description=(
            "Measure this machine as N local devices (one process each, all running at once): fp32 matmul "
            "throughput and memory bandwidth of a process, gloo all-reduce, all-gather and point-to-point latency "
            "and bandwidth between the processes at several sizes, and then the host overheads of our executors "
            "(per operator, per sharded operator, per pipeline microbatch, per step, per message), fitted on small "
            "probe plans run for real. Writes a cluster file for --cluster FILE. Calibrate with as many processes "
            "as the plans will run on (--processes 4 for 4 local ranks). Run it on an idle machine."
        ),
    )
    parser.add_argument("--out", default="cluster.json", metavar="FILE", help="cluster file to write (.json or .toml)")
    parser.add_argument("--processes", type=int, default=2, metavar="N", help="local processes to measure between")
    parser.add_argument("--quick", action="store_true", help="fewer sizes, repeats and probe steps")
    parser.add_argument("--no-probes", action="store_true", help="skip the executor probes (keeps raw figures only)")
    return parser


def run_calibrate(argv: Sequence[str]) -> int:
    from executors.calibrate import check_output_path, write_cluster_file

    options = _parser().parse_args(list(argv))
    check_output_path(options.out)

    def progress(message: str) -> None:
        sys.stderr.write(f"{message}\n")

    probe_steps = 0 if options.no_probes else (3 if options.quick else 10)
    result = calibrate_machine(
        num_processes=options.processes, quick=options.quick, progress=progress, probe_steps=probe_steps
    )
    path = write_cluster_file(result, options.out)
    cluster = result.to_cluster()
    print(
        f"wrote {path}: {cluster.device.peak('float32') / 1e9:.1f} GFLOP/s fp32, "
        f"{cluster.device.memory_bandwidth / 1e9:.2f} GB/s memory, "
        f"link latency {cluster.intra_node.latency_s * 1e6:.0f} µs, bandwidth {cluster.intra_node.bandwidth / 1e9:.2f} GB/s"
    )
    print(f"use it with: plan MODEL_FILE --cluster {path} --batch-size B")
    return 0


def calibrate_machine(
    *,
    num_processes: int,
    progress: Callable[[str], None],
    quick: bool = False,
    probe_steps: int = 10,
    cost_model: str = "roofline",
    probe_attempts: int = 1,
) -> CalibrationResult:
    """The raw measurements of :func:`executors.calibrate.run_calibration`, then (``probe_steps`` > 0) the
    executors' host overheads fitted on probe plans run for real (``probe_attempts`` times, each probe's
    least disturbed timing kept), under ``cost_model`` (``profiled``: also the compute contention,
    :mod:`planner.cli.calibrate_runtime`)."""
    from executors.calibrate import run_calibration
    from planner.cli.calibrate_runtime import fit_runtime_overheads

    result = run_calibration(num_processes=num_processes, quick=quick, progress=progress)
    if probe_steps <= 0:
        return result
    runtime = fit_runtime_overheads(
        result.to_cluster(),
        world=num_processes,
        steps=probe_steps,
        report=progress,
        cost_model=cost_model,
        attempts=probe_attempts,
    )
    progress("fit runtime: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in runtime.values.items()))
    return replace(result, runtime=runtime)


CALIBRATED_BY_DEFAULT = ("local-cpu",)  # presets of this machine: planned calibrated unless --no-calibrate
CALIBRATE_ENV = "AUTOPLAN_CALIBRATE"  # "0": never calibrate by default (the test suite sets it)


def planning_cluster(
    name: str, *, num_nodes: int | None, devices_per_node: int | None, calibrate: bool, say: Callable[[str], None]
) -> Cluster:
    """The cluster ``plan`` prices with: ``name`` as :func:`cost_models.cluster.load_cluster` reads it, except that
    this machine's preset (``local-cpu``) is replaced by this machine's cached calibration for that many processes
    — measured once by ``plan calibrate --quick`` when none is cached, saying so in one line — and any cluster by
    its cached entry when ``plan tune`` wrote one; unless ``calibrate`` is False (``--no-calibrate``) or
    ``$AUTOPLAN_CALIBRATE`` is ``0``."""
    import os

    from cost_models.cluster import load_cluster
    from cost_models.fitting.calibration_store import calibration_path, load_calibrated, save_calibrated

    cluster = load_cluster(name, num_nodes=num_nodes, devices_per_node=devices_per_node)
    if not calibrate or os.environ.get(CALIBRATE_ENV, "1") == "0":
        return cluster
    cached = load_calibrated(cluster.name, processes=cluster.num_devices)  # plan tune's corrections, any cluster
    if cached is not None:
        return replace(cached, name=cluster.name).with_shape(
            num_nodes=cluster.num_nodes, devices_per_node=cluster.devices_per_node
        )
    if name not in CALIBRATED_BY_DEFAULT or cluster.num_nodes != 1:
        return cluster
    processes = cluster.devices_per_node
    if cached is None:
        path = calibration_path(name, processes=processes)
        say(
            f"calibrating this machine for {processes} processes, once (about a minute; cached in {path}; "
            "--no-calibrate plans with the rough preset figures)"
        )
        even = processes >= 2 and processes % 2 == 0  # the runtime probes need pairs of processes
        result = calibrate_machine(
            num_processes=processes, quick=True, progress=lambda message: None, probe_steps=3 if even else 0
        )
        save_calibrated(result.to_json(), name, processes=processes)
        cached = load_calibrated(name, processes=processes)
        assert cached is not None, "internal error (please report): a saved calibration does not load back"
    return replace(cached, name=name).with_shape(num_nodes=1, devices_per_node=processes)


def cluster_of(options: argparse.Namespace) -> Cluster:
    """The cluster of ``--cluster``, ``--nodes``, ``--devices-per-node``, calibrated where it is this machine
    (:func:`planner.cli.calibrate.planning_cluster`); the calibration run says so on stderr."""

    def say(message: str) -> None:
        sys.stderr.write(f"plan: {message}\n")
        sys.stderr.flush()

    return planning_cluster(
        options.cluster,
        num_nodes=options.nodes,
        devices_per_node=options.devices_per_node,
        calibrate=not options.no_calibrate,
        say=say,
    )
