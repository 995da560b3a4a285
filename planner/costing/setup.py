"""Everything that turns a plan into seconds and bytes: the cluster, the compute model, the optimizer, the runtime.

:class:`CostSetup` is shared by every search and by the simulator. :func:`make_compute_model` picks
the compute model: the roofline of the cluster's device (any device), or node times measured on
this machine's CPU (``profiled``, :mod:`cost_models.profiling.profiler`); with ``profiled``, :func:`make_codec_fits`
adds the compressor timings ``plan profile`` stored (:mod:`cost_models.profiling.codec_profiler`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from cost_models.cluster import Cluster, describe_memory_budget, memory_budget_bytes
from cost_models.compute import ComputeModel, RooflineCompute
from cost_models.loss_memory import DEFAULT_BYTES_PER_OUTPUT_ELEMENT
from planner.costing.runtime_profiles import AUTOPLAN, RuntimeProfile, runtime_profile
from planner.errors import AutoplanError
from planner.ir.graph import OpGraph
from planner.plan import Plan
from planner.plan.stage import loss_row_split

if TYPE_CHECKING:
    from cost_models.profiling.codec_profiler import CodecFit

COST_MODELS = ("roofline", "profiled")


@dataclass(frozen=True, kw_only=True)
class CostSetup:
    """Everything that turns a plan into seconds and bytes."""

    cluster: Cluster
    compute: ComputeModel
    optimizer: str
    memory_fraction: float = 1.0  # share of the usable memory: capacity less the device's reserve
    # how the system running the plan syncs gradients and steps the optimizer (planner.costing.runtime_profiles)
    runtime: RuntimeProfile = AUTOPLAN
    # what the model file's loss holds at its peak per element of the outputs it reads (cost_models.loss_memory;
    # the default: the mean's float32 gradient, when the loss is not known)
    loss_bytes_per_output_element: float = DEFAULT_BYTES_PER_OUTPUT_ELEMENT
    # the model's outputs are batch-major and the batch has this many rows: a sharded last stage keeps its rows of
    # them and runs the loss there (planner.plan.stage.loss_row_axes); 0: they are gathered whole on each of its devices
    loss_rows_batch_size: int = 0
    # the gathered syncs' encode/decode times plan profile measured, by sync label (make_codec_fits; empty: none,
    # their compute priced at the device's streaming bandwidth)
    codec_fits: Mapping[str, CodecFit] = field(default_factory=dict)

    def loss_rows(self, mesh_shape: tuple[int, ...], *, num_microbatches: int) -> int:
        """How many pieces a last stage on ``mesh_shape`` cuts its outputs' rows into
        (:func:`planner.plan.stage.loss_row_axes`; 1: whole on each device)."""
        if not self.loss_rows_batch_size or self.runtime.local_outputs:
            return 1
        return loss_row_split(mesh_shape, rows=self.loss_rows_batch_size // num_microbatches)

    @property
    def activation_itemsize(self) -> int | None:
        return 2 if self.cluster.device.mixed_precision else None

    @property
    def memory_budget_bytes(self) -> float:
        """(capacity - reserve) x memory_fraction (:func:`cost_models.cluster.memory_budget_bytes`)."""
        return memory_budget_bytes(self.cluster, memory_fraction=self.memory_fraction)

    def describe_budget(self) -> str:
        """The budget with its capacity, reserve and fraction, for messages."""
        return describe_memory_budget(self.cluster, memory_fraction=self.memory_fraction)


def default_optimizer(cluster: Cluster) -> str:
    return "adam-mixed" if cluster.device.mixed_precision else "adam-fp32"


def make_compute_model(graph: OpGraph, cluster: Cluster, *, cost_model: str, repeats: int = 5) -> ComputeModel:
    """The roofline for ``cluster``'s device, or node times measured on this machine's CPU.

    Measuring runs one thread (one local device per core, as ``local-cpu`` assumes) and uses the
    on-disk profile cache; nodes of other graphs (other microbatch sizes) are measured when first
    priced; nodes it cannot time fall back to the roofline. Measured times are multiplied by the
    device's ``shared_slowdown`` (a calibrated cluster of more processes than cores).
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
    from cost_models.profiling.profiler import NodeMeasurer, ProfileCache, profile_graph

    cache = ProfileCache(device="cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = profile_graph(graph, repeats=repeats, cache=cache)
    finally:
        torch.set_num_threads(threads)
    device = cluster.device
    return ProfiledCompute(
        table=result.times,
        fallback=roofline,
        measure=NodeMeasurer(cache=cache, repeats=repeats),
        slowdown=device.shared_slowdown,
        overhead_s=device.kernel_overhead_s,
    )


def make_codec_fits(cluster: Cluster, *, cost_model: str) -> dict[str, CodecFit]:
    """The compressor fits ``plan profile`` stored on this machine (:mod:`cost_models.profiling.codec_profiler`) when
    the compute is measured here (``profiled``, this machine's CPU); none under the roofline."""
    if cost_model != "profiled" or not cluster.device.name.startswith("cpu"):
        return {}
    from cost_models.profiling.codec_profiler import load_codec_fits

    return load_codec_fits("cpu")


def plan_setup(plan: Plan) -> CostSetup:
    """The setup a saved plan's stored strategies are priced with: its cluster, optimizer, runtime and the loss's
    bytes per output element the search measured and whether its outputs are batch-major (so the replay charges the
    memory the estimate did), roofline
    compute (a plan does not keep measured times)."""
    return CostSetup(
        cluster=plan.cluster,
        compute=RooflineCompute(device=plan.cluster.device),
        optimizer=plan.optimizer,
        memory_fraction=plan.memory_fraction,
        runtime=runtime_profile(plan.runtime),
        loss_bytes_per_output_element=plan.loss_bytes_per_output_element,
        loss_rows_batch_size=plan.batch_size if plan.outputs_batch_major else 0,
    )


def loss_bytes_per_output_element(
    model_file: str | None, model_args: dict, graph: OpGraph, *, batch_size: int
) -> float:
    """What the model file's loss holds at its peak per element of ``graph``'s outputs (``graph`` at ``batch_size``
    rows; :func:`cost_models.loss_memory.loss_bytes_per_output_element`), run on meta tensors; the default loss's
    figure when there is no model file or its loss cannot run on meta tensors."""
    from cost_models.loss_memory import loss_bytes_per_output_element as measure
    from planner.ir.model_file import instantiate_inputs, instantiate_targets, load_model_file

    if model_file is None:
        return DEFAULT_BYTES_PER_OUTPUT_ELEMENT
    try:
        loaded = load_model_file(model_file)
        if loaded.loss_fn is None:
            return DEFAULT_BYTES_PER_OUTPUT_ELEMENT
        make = instantiate_targets if loaded.has_targets else instantiate_inputs
        data = make(loaded, batch_size=batch_size, model_args=dict(model_args), on_meta=True)
        outputs = [_meta_tensor(graph, name) for name in graph.outputs]
        return measure(loaded.loss_fn, outputs, data)
    except Exception:  # a loss that meta tensors cannot run (data-dependent shapes): the default figure
        return DEFAULT_BYTES_PER_OUTPUT_ELEMENT


def _meta_tensor(graph: OpGraph, name: str) -> torch.Tensor:
    from planner.ir.node_call import torch_dtype

    meta = graph.node(name).output if graph.has_node(name) else graph.value(name).meta
    return torch.empty(meta.shape, dtype=torch_dtype(meta.dtype), device="meta")
