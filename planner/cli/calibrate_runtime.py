"""Fit the executors' host overheads on this machine: run probe plans, compare with the estimate.

``plan calibrate`` measures the raw machine (matmul, memory, gloo collectives); what our executors
add around that — DTensor dispatch on every operator of a multi-device stage, the pipeline
schedule's per-microbatch work, collectives issued through DTensor, the interpreter's per-operator
call — is measured here. Each probe is the narrow residual MLP of :mod:`executors.probe_model`
(arithmetic negligible) planned by a fixed method on ``world`` local processes (:data:`PROBES`:
data parallel, Megatron tensor parallel and pipelines of 2 stages at several depths and
microbatch counts), saved, and timed by :func:`executors.step_timing.run_timing`. Its features
are the estimate's slopes in the runtime constants (:func:`cost_models.runtime_fit.probe_features`,
re-planning under changed constants), and :func:`cost_models.runtime_fit.fit_runtime` fits them.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from cost_models.cluster import Cluster
from cost_models.compute import RooflineCompute
from cost_models.runtime_fit import ProbeRow, RuntimeFit, fit_runtime, probe_features
from planner.errors import AutoplanError

PROBE_FILE = Path(__file__).with_name("probe_model.py")
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


def probe_degrees(kind: str, world: int) -> tuple[int, int, int]:
    return (world, 1, 1) if kind == "tensor" else (1, 2, world // 2)


def fit_runtime_overheads(
    cluster: Cluster, *, world: int, steps: int, report: Callable[[str], None], timeout_s: float = 1200.0
) -> RuntimeFit:
    """Plan, run and fit the probes on ``world`` local processes (``cluster`` sized to them)."""
    from executors.step_timing import run_timing
    from planner.api import plan_prepared, prepare_model_file
    from planner.plan import save_plan

    if world < 2 or world % 2:
        raise AutoplanError(f"runtime probes need an even number of processes, at least 2; got {world}")
    cluster = cluster.with_shape(num_nodes=1, devices_per_node=world)
    prepared, paths = {}, {}
    with tempfile.TemporaryDirectory(prefix="autoplan-probes-") as directory:
        for name, (width, layers, activations, batch, method, options) in PROBES.items():
            options = dict(options)
            if "degrees" in options:
                options["degrees"] = probe_degrees(options["degrees"], world)
            prepared[name] = prepare_model_file(PROBE_FILE, cluster, batch_size=batch, optimizer="sgd",
                                                model_args={"width": width, "layers": layers, "activations": activations}, **options)  # fmt: skip
            paths[name] = str(Path(directory) / f"{name}.json")
            save_plan(plan_prepared(prepared[name], method), paths[name])
        report(f"runtime probes: {len(PROBES)} plans on {world} processes, {steps} timed steps each")
        measured = run_timing(list(paths.values()), world=world, steps=steps, out=Path(directory) / "measured.json",
                              timeout_s=timeout_s)  # fmt: skip
    rows = []
    for name, (*_, method, _) in PROBES.items():

        def estimate(changed: Cluster, name: str = name, method: str = method) -> float:
            base = prepared[name]
            setup = replace(base.setup, cluster=changed, compute=RooflineCompute(device=changed.device))
            return plan_prepared(replace(base, setup=setup, auto=None), method).estimate.step_time_s

        base_s, features = probe_features(estimate, cluster)
        rows.append(ProbeRow(name=name, measured_s=measured[paths[name]], base_s=base_s, features=features))
        report(f"probe {name}: measured {rows[-1].measured_s * 1e3:.2f} ms")
    fit = fit_runtime(rows)
    for row in fit.rows:
        report(f"probe {row.name}: measured {row.measured_s * 1e3:.2f} ms, fitted {fit.predicted_s(row) * 1e3:.2f} ms")
    return fit
