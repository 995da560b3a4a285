"""Calibrate this machine: the raw measurements, then the executors' host overheads fitted on probe plans.

:func:`calibrate_machine` is what ``plan calibrate`` runs (:mod:`calibration.measure` measures processes and
gloo collectives, :mod:`calibration.fit` fits them, :mod:`calibration.probes` plans, runs and fits the
executor probes); :func:`planning_cluster` is the cluster every ``plan`` command prices with — this machine's
cached calibration (:mod:`calibration.store`) by default, measured once when none is cached.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace

from calibration.fit import CalibrationResult
from cost_models.cluster import Cluster, load_cluster

CALIBRATED_BY_DEFAULT = ("local-cpu",)  # presets of this machine: planned calibrated unless --no-calibrate
CALIBRATE_ENV = "AUTOPLAN_CALIBRATE"  # "0": never calibrate by default (the test suite sets it)


def calibrate_machine(
    *,
    num_processes: int,
    progress: Callable[[str], None],
    quick: bool = False,
    probe_steps: int = 10,
    cost_model: str = "roofline",
    probe_attempts: int = 1,
) -> CalibrationResult:
    """The raw measurements of :func:`calibration.measure.run_calibration`, then (``probe_steps`` > 0) the
    executors' host overheads fitted on probe plans run for real (``probe_attempts`` times, each probe's
    least disturbed timing kept), under ``cost_model`` (``profiled``: also the compute contention,
    :mod:`calibration.probes`)."""
    from calibration.measure import run_calibration
    from calibration.probes import fit_runtime_overheads

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


def planning_cluster(
    name: str, *, num_nodes: int | None, devices_per_node: int | None, calibrate: bool, say: Callable[[str], None]
) -> Cluster:
    """The cluster ``plan`` prices with: ``name`` as :func:`cost_models.cluster.load_cluster` reads it, except that
    this machine's preset (``local-cpu``) is replaced by this machine's cached calibration for that many processes
    — measured once by ``plan calibrate --quick`` when none is cached, saying so in one line — and any cluster by
    its cached entry when ``plan tune`` wrote one; unless ``calibrate`` is False (``--no-calibrate``) or
    ``$AUTOPLAN_CALIBRATE`` is ``0``."""
    from calibration.store import calibration_path, load_calibrated, save_calibrated

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
