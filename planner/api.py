"""The library entry point: ``plan(model, example_inputs, cluster, *, batch_size) -> Plan``.

:func:`plan` captures the model (:mod:`planner.capture`), builds the cost setup (cluster,
compute model, optimizer), runs the chosen method and returns a validated :class:`Plan`.
:func:`plan_model_file` does the same from a model file, building the model on the meta
device so that nothing is allocated. Methods are looked up in :data:`METHODS`; ``auto``
picks the best plan the planner can search (in this version: one stage over every device,
sharded per operator by the intra-op ILP on the best logical mesh).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from cost_models.cluster import Cluster, load_cluster
from cost_models.compute import ComputeModel, RooflineCompute
from planner.baselines.data_parallel import data_parallel
from planner.capture import capture
from planner.errors import AutoplanError
from planner.estimate import CostSetup
from planner.graph import OpGraph
from planner.intra_op import IntraOpOptions
from planner.model_file import instantiate, load_model_file
from planner.plan import Estimate, ModelRef, Plan, SearchStats, Stage, validate_plan
from planner.single_stage import logical_meshes, single_stage_plan

METHODS: dict[str, str] = {
    "auto": "the best plan autoplan can search (this version: one stage, per-operator sharding by ILP "
    "over every logical mesh of the devices)",
    "data-parallel": "every device holds the model and a 1/d slice of the batch",
}
COST_MODELS = ("roofline", "profiled")


def _run_method(
    name: str, graph: OpGraph, setup: CostSetup, *, batch_size: int, options: IntraOpOptions
) -> tuple[tuple[Stage, ...], Estimate, int]:
    """Stages, estimate and the number of ILP solves of method ``name``."""
    if name == "data-parallel":
        return (*data_parallel(graph, setup, batch_size=batch_size), 0)
    stages, estimate, _ = single_stage_plan(graph, setup, options=options)
    return stages, estimate, len(logical_meshes(setup.cluster.num_devices, setup.cluster.devices_per_node))


def default_optimizer(cluster: Cluster) -> str:
    return "adam-mixed" if cluster.device.mixed_precision else "adam-fp32"


def _resolve_cluster(cluster: Cluster | str) -> Cluster:
    return cluster if isinstance(cluster, Cluster) else load_cluster(cluster)


def make_compute_model(graph: OpGraph, cluster: Cluster, *, cost_model: str, repeats: int = 5) -> ComputeModel:
    """The roofline for ``cluster``'s device, or node times measured on this machine's CPU.

    Measuring runs one thread (one local device per core, as ``local-cpu`` assumes) and uses the
    on-disk profile cache; nodes it cannot time fall back to the roofline.
    """
    roofline = RooflineCompute(device=cluster.device)
    if cost_model == "roofline":
        return roofline
    if cost_model != "profiled":
        raise AutoplanError(f"unknown cost model {cost_model!r}: use one of {', '.join(COST_MODELS)}")
    if not cluster.device.name.startswith("cpu"):
        raise AutoplanError(
            f"measured times are for this machine's CPU, but cluster {cluster.name} has {cluster.device.name} "
            "devices: use the roofline, or --cluster local-cpu / a file from `plan calibrate`"
        )
    from cost_models.compute import ProfiledCompute
    from cost_models.profiler import ProfileCache, profile_graph

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = profile_graph(graph, repeats=repeats, cache=ProfileCache(device="cpu"))
    finally:
        torch.set_num_threads(threads)
    return ProfiledCompute(table=result.times, fallback=roofline)


def plan(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    cluster: Cluster | str,
    *,
    batch_size: int,
    method: str = "auto",
    tracer: str = "export",
    optimizer: str | None = None,
    cost_model: str = "roofline",
    memory_fraction: float = 1.0,
    max_stages: int = 1,
    zero: bool = False,
    ilp_time_limit_s: float = 30.0,
    model_ref: dict[str, Any] | None = None,
) -> Plan:
    """Find a parallel plan for training ``model`` on ``cluster`` with global ``batch_size``.

    ``example_inputs`` are one step's inputs at ``batch_size``. The model may live on the
    meta device. Raises :class:`AutoplanError` for bad input or a model that does not fit.
    """
    if method not in METHODS:
        raise AutoplanError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")
    if batch_size <= 0:
        raise AutoplanError(f"--batch-size must be a positive integer, got {batch_size}")
    if max_stages < 1:
        raise AutoplanError(f"--max-stages must be at least 1, got {max_stages}")
    if not 0 < memory_fraction <= 1:
        raise AutoplanError(f"--memory-fraction must be in (0, 1], got {memory_fraction}")
    cluster = _resolve_cluster(cluster)
    started = time.perf_counter()
    graph = capture(model, example_inputs, tracer=tracer)
    captured = time.perf_counter()
    setup = CostSetup(
        cluster=cluster,
        compute=make_compute_model(graph, cluster, cost_model=cost_model),
        optimizer=optimizer or default_optimizer(cluster),
        memory_fraction=memory_fraction,
    )
    costed = time.perf_counter()
    options = IntraOpOptions(zero=zero, time_limit_s=ilp_time_limit_s)
    stages, estimate, ilp_solves = _run_method(method, graph, setup, batch_size=batch_size, options=options)
    finished = time.perf_counter()
    ref = dict(model_ref or {})
    result = Plan(
        method=method,
        model=ModelRef(
            fingerprint=graph.fingerprint(),
            num_params=graph.num_params,
            file=ref.get("file"),
            args=ref.get("args", {}),
            tracer=tracer,
        ),
        cluster=cluster,
        batch_size=batch_size,
        num_microbatches=1,
        schedule="none",
        optimizer=setup.optimizer,
        stages=stages,
        estimate=estimate,
        search=SearchStats(
            time_s=finished - started, capture_s=captured - started, cost_s=costed - captured, ilp_solves=ilp_solves
        ),
        notes=_notes(method, cost_model, max_stages),
    )
    validate_plan(result, graph)
    return result


def _notes(method: str, cost_model: str, max_stages: int) -> tuple[str, ...]:
    notes = [f"compute times: {cost_model}", "gradient all-reduce is not overlapped with backward in the estimate"]
    if method == "auto":
        notes.insert(0, "auto searched one stage: per-operator sharding by ILP on every logical mesh")
        if max_stages > 1:
            notes.insert(1, f"--max-stages {max_stages}: pipeline stages are not searched yet in this version")
    return tuple(notes)


def plan_model_file(
    path: str | Path,
    cluster: Cluster | str,
    *,
    batch_size: int,
    model_args: dict[str, Any] | None = None,
    **options: Any,
) -> Plan:
    """:func:`plan` for a model file, built on the meta device."""
    model_file = load_model_file(path)
    args = dict(model_args or {})
    model, inputs = instantiate(model_file, batch_size=batch_size, model_args=args)
    return plan(model, inputs, cluster, batch_size=batch_size, model_ref={"file": str(path), "args": args}, **options)
