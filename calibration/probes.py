"""Fit the executors' host overheads on this machine: run probe plans, compare with the estimate.

``plan calibrate`` measures the raw machine (matmul, memory, gloo collectives); what our executors
add around that — DTensor dispatch on every operator of a multi-device stage, the pipeline
schedule's per-microbatch work, collectives issued through DTensor, the interpreter's per-operator
call — is measured here. Each probe is the narrow residual MLP of :mod:`calibration.probe_model`
(arithmetic negligible) planned by a fixed method on ``world`` local processes (:data:`PROBES`:
data parallel, Megatron tensor parallel and pipelines of 2 stages at several depths and
microbatch counts), saved, and timed by :func:`executors.measure.step_timing.run_timing`. Its features
are the estimate's slopes in the runtime constants (:func:`calibration.runtime_fit.probe_features`,
re-planning under changed constants), and :func:`calibration.runtime_fit.fit_runtime` fits them.

``cost_model="profiled"`` fits the constants under the compute model the plans will be priced with
(operator times profiled here × ``shared_slowdown``, not the roofline: the slopes are then the ones
that model's estimates have) and adds :data:`COMPUTE_PROBES` — the residual MLP of
``examples/mlp.py`` at real widths, whose steps are mostly arithmetic — so the fit also finds how
much slower the processes compute while they share the cores (``compute_extra``,
:data:`calibration.runtime_fit.COMPUTE`).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from calibration.runtime_fit import CONSTANTS, ProbeRow, RuntimeFit, fit_runtime, probe_features
from cost_models.cluster import Cluster
from cost_models.compute import ProfiledCompute, RooflineCompute
from planner.costing.setup import CostSetup
from planner.errors import AutoplanError

if TYPE_CHECKING:
    from planner.api import Prepared

PROBE_FILE = Path(__file__).with_name("probe_model.py")
COMPUTE_PROBE_FILE = Path(__file__).resolve().parents[1] / "examples" / "mlp.py"
# name -> (width, layers, GELUs per block, batch, method, options); degrees "tensor" = (world, 1, 1),
# "pipeline" = (1, 2, world / 2). Width 16: the arithmetic is negligible, the runtime's overheads show.
PROBES: dict[str, tuple[int, int, int, int, str, dict]] = {
    "dp-4": (16, 4, 1, 16, "data-parallel", {}),
    "dp-12x4": (16, 12, 4, 16, "data-parallel", {}),
    "tp-4": (16, 4, 1, 16, "megatron", {"degrees": "tensor"}),
    "tp-8": (16, 8, 1, 16, "megatron", {"degrees": "tensor"}),
    "tp-4x6": (16, 4, 6, 16, "megatron", {"degrees": "tensor"}),
    "gpipe-8x2": (16, 8, 1, 16, "megatron", {"degrees": "pipeline", "schedule": "gpipe", "microbatches": 2}),
    "gpipe-8x8": (16, 8, 1, 16, "megatron", {"degrees": "pipeline", "schedule": "gpipe", "microbatches": 8}),
    "1f1b-16x4": (16, 16, 1, 16, "megatron", {"degrees": "pipeline", "schedule": "1f1b", "microbatches": 4}),
}


# Profiled operator times already hold each operator's dispatch: the kernel overhead stays as calibrated
# (it is then only the part of a measured time that does not shrink when the operator is sharded).
PROFILED_CONSTANTS = tuple(k for k in CONSTANTS if k != "kernel_overhead_s")
# name -> (hidden, layers, batch, method, options): examples/mlp.py, mostly arithmetic (tens of ms a step).
COMPUTE_PROBES: dict[str, tuple[int, int, int, str, dict]] = {
    "mlp-dp": (256, 4, 1024, "data-parallel", {}),
    "mlp-tp": (256, 4, 1024, "megatron", {"degrees": "tensor"}),
    "mlp-gpipe": (256, 4, 1024, "megatron", {"degrees": "pipeline", "schedule": "gpipe", "microbatches": 4}),
    "mlp-1f1b": (256, 8, 512, "megatron", {"degrees": "pipeline", "schedule": "1f1b", "microbatches": 4}),
}


def probe_degrees(kind: str, world: int) -> tuple[int, int, int]:
    return (world, 1, 1) if kind == "tensor" else (1, 2, world // 2)


def fit_runtime_overheads(
    cluster: Cluster,
    *,
    world: int,
    steps: int,
    report: Callable[[str], None],
    timeout_s: float = 1200.0,
    cost_model: str = "roofline",
    attempts: int = 1,
) -> RuntimeFit:
    """Plan, run and fit the probes on ``world`` local processes (``cluster`` sized to them), under
    ``cost_model`` (``profiled``: the compute probes and the compute constant too); the probes are
    timed ``attempts`` times and each keeps its least disturbed timing (:func:`_least_disturbed`)."""
    from planner.api import plan_prepared
    from planner.plan import save_plan

    if world < 2 or world % 2:
        raise AutoplanError(f"runtime probes need an even number of processes, at least 2; got {world}")
    cluster = cluster.with_shape(num_nodes=1, devices_per_node=world)
    profiled = cost_model == "profiled"
    probes = _probe_configs(profiled=profiled)
    prepared, paths = {}, {}
    with tempfile.TemporaryDirectory(prefix="autoplan-probes-") as directory:
        for name, (path, args, batch, method, options) in probes.items():
            prepared[name] = _prepare(
                path, cluster, world=world, batch=batch, args=args, options=options, cost_model=cost_model
            )
            paths[name] = str(Path(directory) / f"{name}.json")
            save_plan(plan_prepared(prepared[name], method), paths[name])
        report(f"runtime probes: {len(probes)} plans on {world} processes, {steps} timed steps each, {attempts} run(s)")
        measured = _time_probe_plans(
            list(paths.values()),
            directory=Path(directory),
            world=world,
            steps=steps,
            timeout_s=timeout_s,
            attempts=attempts,
        )
    rows = []
    for name, (*_, method, _) in probes.items():
        rows.append(
            _probe_row(
                name, prepared[name], method, cluster=cluster, measured_s=measured[paths[name]], profiled=profiled
            )
        )
        report(f"probe {name}: measured {rows[-1].measured_s * 1e3:.2f} ms")
    fit = fit_runtime(rows)
    for row in fit.rows:
        report(f"probe {row.name}: measured {row.measured_s * 1e3:.2f} ms, fitted {fit.predicted_s(row) * 1e3:.2f} ms")
    return fit


def _time_probe_plans(
    paths: list[str], *, directory: Path, world: int, steps: int, timeout_s: float, attempts: int
) -> dict[str, float]:
    """Time the saved probe plans ``attempts`` times on ``world`` local processes; per plan, the least
    disturbed of those timings (:func:`_least_disturbed`)."""
    from executors.measure.step_timing import run_timing

    return _least_disturbed(
        [
            run_timing(paths, world=world, steps=steps, out=directory / f"measured-{i}.json", timeout_s=timeout_s)
            for i in range(attempts)
        ],
        [json.loads((directory / f"measured-{i}.json.machine.json").read_text()) for i in range(attempts)],
    )


def _probe_row(
    name: str, base: Prepared, method: str, *, cluster: Cluster, measured_s: float, profiled: bool
) -> ProbeRow:
    """One probe's fit row: its measured step time and the estimate's slopes in the runtime constants,
    re-planning the prepared probe by ``method`` under changed constants (and compute scale, if ``profiled``)."""
    from planner.api import plan_prepared

    def scaled(changed: Cluster, scale: float) -> float:
        return plan_prepared(replace(base, setup=_setup(base.setup, changed, scale)), method).estimate.step_time_s

    def estimate(changed: Cluster) -> float:
        return scaled(changed, 1.0)

    base_s, features = probe_features(
        estimate,
        cluster,
        scaled=scaled if profiled else None,
        constants=PROFILED_CONSTANTS if profiled else CONSTANTS,
    )
    return ProbeRow(name=name, measured_s=measured_s, base_s=base_s, features=features)


def _least_disturbed(runs: list[dict[str, float]], machine: list[dict[str, dict[str, float]]]) -> dict[str, float]:
    """Per plan, the run whose timed steps had the least share of the CPU taken by the VM's host and
    other processes (``executors.measure.step_timing``'s machine shares; the earlier run on a tie)."""

    def disturbance(index: int, path: str) -> float:
        shares = machine[index].get(path, {})
        return round(shares.get("steal", 0.0) + shares.get("foreign", 0.0), 3)

    return {path: runs[min(range(len(runs)), key=lambda i: (disturbance(i, path), i))][path] for path in runs[0]}


def _probe_configs(*, profiled: bool) -> dict[str, tuple[Path, dict, int, str, dict]]:
    """name -> (model file, model args, batch, method, options) of the probes a fit runs."""
    configs = {
        name: (PROBE_FILE, {"width": width, "layers": layers, "activations": activations}, batch, method, options)
        for name, (width, layers, activations, batch, method, options) in PROBES.items()
    }
    if profiled:
        for name, (hidden, layers, batch, method, options) in COMPUTE_PROBES.items():
            configs[name] = (COMPUTE_PROBE_FILE, {"hidden": hidden, "layers": layers}, batch, method, options)
    return configs


def _prepare(
    path: Path, cluster: Cluster, *, world: int, batch: int, args: dict, options: dict, cost_model: str
) -> Prepared:
    from planner.api import prepare_model_file

    options = dict(options)
    if "degrees" in options:
        options["degrees"] = probe_degrees(options["degrees"], world)
    return prepare_model_file(
        path, cluster, batch_size=batch, optimizer="sgd", model_args=args, cost_model=cost_model, **options
    )


def _setup(setup: CostSetup, changed: Cluster, scale: float) -> CostSetup:
    """``setup`` on cluster ``changed``, compute times × ``scale``: the roofline of the changed device,
    or the same profiles with the changed device's slowdown and kernel overhead."""
    roofline = RooflineCompute(device=changed.device)
    if isinstance(setup.compute, ProfiledCompute):
        device = changed.device
        compute = replace(
            setup.compute,
            fallback=roofline,
            slowdown=device.shared_slowdown * scale,
            overhead_s=device.kernel_overhead_s,
        )
        return replace(setup, cluster=changed, compute=compute)
    return replace(setup, cluster=changed, compute=roofline)
