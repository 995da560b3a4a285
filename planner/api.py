"""The library entry point: ``plan(model, example_inputs, cluster, *, batch_size) -> Plan``.

:func:`plan` captures the model (:mod:`planner.capture`), builds the cost setup (cluster,
compute model, optimizer), runs the chosen method and returns a validated :class:`Plan`.
:func:`plan_model_file` does the same from a model file, building the model on the meta
device so that nothing is allocated. Methods are looked up in :data:`METHODS`; ``auto`` is the
two-level search (:mod:`planner.auto`): pipeline stages on submeshes by DP, each operator's
sharding by the intra-op problem, microbatches, schedule and recomputation; ``megatron`` and
``uniform-pipeline`` are the best hand-written plans of those kinds under the same cost model.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from cost_models.cluster import Cluster, load_cluster
from cost_models.compute import ComputeModel, RooflineCompute
from planner.auto import auto_plan
from planner.baselines.data_parallel import data_parallel
from planner.capture import capture
from planner.errors import AutoplanError
from planner.estimate import GIB, CostSetup
from planner.graph import OpGraph
from planner.inter_op import PipelineOptions, Progress, allowed_slots, microbatch_counts
from planner.model_file import instantiate, load_model_file
from planner.pipeline_plan import PricedPipeline
from planner.plan import ModelRef, Plan, SearchStats, validate_plan
from planner.rebatch import MicrobatchGraphs

METHODS: dict[str, str] = {
    "auto": "the best plan autoplan can search: pipeline stages by DP, per-operator sharding by ILP, "
    "microbatches, schedule and recomputation",
    "data-parallel": "every device holds the model and a 1/d slice of the batch",
    "megatron": "the best Megatron (tensor, pipeline, data) grid point, priced like auto",
    "uniform-pipeline": "equal layers per stage on equal submeshes, each stage sharded by ILP",
}
COST_MODELS = ("roofline", "profiled")


def _run_method(
    name: str, graphs: MicrobatchGraphs, setup: CostSetup, *, batch_size: int, options: PipelineOptions,
    progress: Progress | None,
) -> tuple[PricedPipeline, SearchStats, tuple[str, ...]]:  # fmt: skip
    """The plan of method ``name``, its search statistics (capture filled in later) and notes."""
    graph = graphs.at(batch_size)
    if name == "data-parallel":
        stages, estimate = data_parallel(graph, setup, batch_size=batch_size)
        return (
            PricedPipeline(stages=stages, estimate=estimate, num_microbatches=1, schedule="none"),
            SearchStats(time_s=0.0),
            (),
        )
    result = auto_plan(graphs, graph, setup, options=options, progress=progress)
    if name != "auto" and name not in result.priced:
        raise AutoplanError(f"no {name} plan fits in {setup.memory_budget_bytes / GIB:.1f} GiB per device")
    chosen = result.best if name == "auto" else result.priced[name]
    stats = SearchStats(time_s=0.0, ilp_solves=result.num_solves, ilp_s=result.ilp_s, dp_s=result.dp_s,
                        price_s=result.price_s)  # fmt: skip
    compared = ", ".join(f"{method} {p.estimate.step_time_s:.4g} s" for method, p in sorted(result.priced.items()))
    notes = (f"compared under the same cost model: {compared}; chosen: {result.chosen_by if name == 'auto' else name}",)
    return chosen, stats, notes


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
    max_stages: int | None = None,
    microbatches: int | None = None,
    schedule: str = "auto",
    remat: str = "auto",
    zero: bool = False,
    ilp_time_limit_s: float = 30.0,
    model_ref: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> Plan:
    """Find a parallel plan for training ``model`` on ``cluster`` with global ``batch_size``.

    ``example_inputs`` are one step's inputs at ``batch_size``. The model may live on the
    meta device. ``microbatches`` None searches the counts; ``max_stages`` None allows any.
    ``progress(what, done, total)`` is called during the search. Raises :class:`AutoplanError`
    for bad input or a model that does not fit.
    """
    if method not in METHODS:
        raise AutoplanError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")
    if batch_size <= 0:
        raise AutoplanError(f"--batch-size must be a positive integer, got {batch_size}")
    if max_stages is not None and max_stages < 1:
        raise AutoplanError(f"--max-stages must be at least 1, got {max_stages}")
    pipeline = PipelineOptions(max_stages=max_stages, microbatches=microbatches, schedule=schedule, remat=remat,
                               zero=zero, ilp_time_limit_s=ilp_time_limit_s)  # fmt: skip
    counts = microbatch_counts(batch_size, microbatches) if method != "data-parallel" else [1]
    allowed_slots(remat)
    if not 0 < memory_fraction <= 1:
        raise AutoplanError(f"--memory-fraction must be in (0, 1], got {memory_fraction}")
    cluster = _resolve_cluster(cluster)
    started = time.perf_counter()
    graph = capture(model, example_inputs, tracer=tracer)
    graphs = MicrobatchGraphs(
        full=graph, batch_size=batch_size, smallest=batch_size // counts[-1],
        capture_at=lambda size: capture(model, slice_batch(example_inputs, batch_size, size), tracer=tracer),
    )  # fmt: skip
    captured, captured_before = time.perf_counter(), graphs.capture_s
    setup = CostSetup(
        cluster=cluster,
        compute=make_compute_model(graph, cluster, cost_model=cost_model),
        optimizer=optimizer or default_optimizer(cluster),
        memory_fraction=memory_fraction,
    )
    costed = time.perf_counter()
    chosen, stats, method_notes = _run_method(method, graphs, setup, batch_size=batch_size, options=pipeline,
                                              progress=progress)  # fmt: skip
    finished = time.perf_counter()
    capture_s = captured - started + graphs.capture_s - captured_before
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
        num_microbatches=chosen.num_microbatches,
        schedule=chosen.schedule,
        optimizer=setup.optimizer,
        zero=zero,
        stages=chosen.stages,
        estimate=chosen.estimate,
        search=replace(stats, time_s=finished - started, capture_s=capture_s, cost_s=costed - captured),
        notes=(*method_notes, *_notes(cost_model, graphs)),
    )
    validate_plan(result, graph)
    return result


def _notes(cost_model: str, graphs: MicrobatchGraphs) -> tuple[str, ...]:
    return (
        f"compute times: {cost_model}; model captured {graphs.num_captures} time(s), other microbatch sizes "
        "interpolated",
        "gradient all-reduce is not overlapped with backward in the estimate",
    )


def slice_batch(example_inputs: Sequence[Any], batch_size: int, size: int) -> tuple[Any, ...]:
    """The example inputs at batch ``size``: tensors whose dim 0 is the batch are cut to ``size`` rows."""
    sliced = [
        x[:size] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch_size else x for x in example_inputs
    ]
    if size != batch_size and not any(isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch_size
                                      for x in example_inputs):  # fmt: skip
        raise AutoplanError(f"no example input has the batch ({batch_size}) as dim 0: use --microbatches 1")
    return tuple(sliced)


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
