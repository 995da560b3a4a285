"""A model made ready for every method: captured once, with its cost setup, under one :class:`PlanOptions`.

:func:`prepare_model` captures the model at the batch and at the smallest microbatch the search may try
(:func:`planner.ir.rebatch.capture_graphs`) and builds the cost setup (:class:`planner.costing.setup.CostSetup`:
cluster, compute model, optimizer, memory budget, runtime); :func:`model_from_file` builds a model file's model on
the meta device, with the reference a plan keeps to it. The result, :class:`Prepared`, is frozen: every method of
:mod:`planner.methods` plans on the same one (``plan compare`` runs them all on it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from cost_models.cluster import Cluster
from planner.costing.runtime_profiles import runtime_profile
from planner.costing.setup import (
    CostSetup,
    default_optimizer,
    loss_bytes_per_output_element,
    make_codec_fits,
    make_compute_model,
)
from planner.errors import AutoplanError
from planner.inter.planning_input import PlanningInput
from planner.inter.search import Progress, microbatch_counts
from planner.inter.stage_dp.solver import is_large
from planner.ir.graph import OpGraph
from planner.ir.model_file import instantiate, load_model_file
from planner.ir.rebatch import MicrobatchGraphs, capture_graphs
from planner.options import PlanOptions
from planner.plan import ModelRef


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """A captured model with its cost setup and the options every method run on it reads."""

    graph: OpGraph
    graphs: MicrobatchGraphs
    setup: CostSetup
    model: ModelRef
    batch_size: int
    options: PlanOptions
    capture_s: float
    captured_before_s: float  # graphs.capture_s when prepared (already in capture_s)
    cost_s: float
    notes: tuple[str, ...]
    progress: Progress | None = None

    @property
    def inputs(self) -> PlanningInput:
        """What a planning method reads (:mod:`planner.methods`)."""
        return PlanningInput(graphs=self.graphs, setup=self.setup, options=self.options, progress=self.progress)


def prepare_model(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    cluster: Cluster,
    *,
    batch_size: int,
    options: PlanOptions,
    model_ref: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> Prepared:
    """Capture ``model`` and build its cost setup on ``cluster``; AutoplanError for options the model or the
    cluster cannot take (a batch the microbatches do not divide, ``--degrees`` of another device count)."""
    if batch_size <= 0:
        raise AutoplanError(f"--batch-size must be a positive integer, got {batch_size}")
    data_degree = None if options.degrees is None else options.degrees[2]
    counts = microbatch_counts(batch_size, options.microbatches, data_degree=data_degree)
    options.check_cluster(cluster)
    started = time.perf_counter()
    # at scale the Megatron grid reaches one row per replica (megatron_at_scale): capture down to one row
    one_row = is_large(cluster) and options.degrees is None and options.microbatches is None
    graphs = capture_graphs(
        model,
        example_inputs,
        batch_size=batch_size,
        smallest=1 if one_row else batch_size // counts[-1],
        tracer=options.tracer,
        jobs=options.jobs,
    )
    captured = time.perf_counter()
    ref = dict(model_ref or {})
    setup = _cost_setup(graphs.full, cluster, options=options, ref=ref, batch_size=batch_size)
    if graphs.outputs_batch_major():
        setup = replace(setup, loss_rows_batch_size=batch_size)
    model_json = ModelRef(
        fingerprint=graphs.full.fingerprint(),
        num_params=graphs.full.num_params,
        file=ref.get("file"),
        args=ref.get("args", {}),
        tracer=options.tracer,
        sequence_length=token_sequence_length(graphs.full),
    )
    return Prepared(
        graph=graphs.full,
        graphs=graphs,
        setup=setup,
        model=model_json,
        batch_size=batch_size,
        options=options,
        capture_s=captured - started,
        captured_before_s=graphs.capture_s,
        cost_s=time.perf_counter() - captured,
        notes=(f"compute times: {options.cost_model}",),
        progress=progress,
    )


def token_sequence_length(graph: OpGraph) -> int | None:
    """The second dim of the graph's first input when it is ``batch × sequence`` integer token ids, else None."""
    first = graph.inputs[0].meta if graph.inputs else None
    if first is not None and len(first.shape) == 2 and first.dtype.startswith("int"):
        return int(first.shape[1])
    return None


def _cost_setup(
    graph: OpGraph, cluster: Cluster, *, options: PlanOptions, ref: dict[str, Any], batch_size: int
) -> CostSetup:
    return CostSetup(
        cluster=cluster,
        compute=make_compute_model(graph, cluster, cost_model=options.cost_model),
        codec_fits=make_codec_fits(cluster, cost_model=options.cost_model),
        optimizer=options.optimizer or default_optimizer(cluster),
        memory_fraction=options.memory_fraction,
        runtime=runtime_profile(options.runtime),
        loss_bytes_per_output_element=loss_bytes_per_output_element(
            ref.get("file"), ref.get("args", {}), graph, batch_size=batch_size
        ),
    )


def model_from_file(
    path: str | Path, *, batch_size: int, model_args: dict[str, Any] | None = None
) -> tuple[torch.nn.Module, Sequence[Any], dict[str, Any]]:
    """The model of a model file built on the meta device, its example inputs at ``batch_size`` and the reference a
    plan keeps to it (``file``, absolute: the plan runs from any directory; ``args``)."""
    args = dict(model_args or {})
    model, inputs = instantiate(load_model_file(path), batch_size=batch_size, model_args=args)
    return model, inputs, {"file": str(Path(path).resolve()), "args": args}
