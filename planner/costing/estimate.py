"""Step time, memory and throughput of a plan under one cost model, in seconds and bytes.

The pure data-parallel plan over ``d`` devices is priced as DDP runs it, by the same function as every other
one-stage data-parallel plan (:func:`planner.costing.ddp.ddp_step`); what it holds per device is
:func:`data_parallel_memory_bytes`::

    memory_bytes = weights and optimizer state (memory.py, by optimizer) + DDP's gradient buckets (one more
                   gradient of every parameter on several devices: :func:`ddp_bucket_bytes`) + the peak of one
                   replica's activations, gradients and loss over its forward and backward at 1/d of the
                   batch (:func:`replica_memory`, :mod:`planner.costing.stage_memory`)

The pieces of DDP's price that live here: :data:`DDP_BUCKET_COPIES` (DDP copies gradients into
its buckets and back: ``4 · gradient bytes / memory bandwidth``) and :func:`optimizer_step_s`
(``num_params · (2·(weight + state bytes) + grad bytes) / memory bandwidth``).

A parameter read in several pipeline stages (a tied embedding) has its gradient summed over every
rank after the backward pass (:func:`executors.parallel.stages.sync_shared_grads`), priced by
:func:`shared_param_sync_s`: one all-reduce of the whole gradient per such parameter, over all the
cluster's devices and its slowest link; pipeline plans add it to the step
(:func:`planner.inter.pricing.price_stages`).

Gradient synchronisation overlaps the backward pass where the executor overlaps it: under DDP (pure data
parallelism) and on sharded stages (their buckets, :mod:`executors.parallel.grad_sync`; priced by
:func:`planner.inter.pricing.price_stages`); FSDP's collectives and their overlap are :mod:`planner.costing.zero`'s.
Model FLOPs are those of the captured graph (forward + backward, no recomputation); TFLOP/s per device and model-FLOPs
utilisation (MFU) divide them by step time, device count and the device's peak.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from cost_models.communication import all_reduce_s
from cost_models.memory import optimizer_bytes
from cost_models.memory_timeline import activation_peak
from cost_models.units import GIB
from planner.costing.setup import CostSetup
from planner.costing.stage_memory import StageMemory, grad_values, loss_bytes, replica_node_bytes, stage_tape
from planner.errors import AutoplanError
from planner.ir.graph import OpGraph
from planner.plan import Estimate, Stage

# DDP (gradient_as_bucket_view=False, torch's default) copies each gradient into its bucket before the
# all-reduce and back after it: two reads and two writes of every gradient byte.
DDP_BUCKET_COPIES = 4


def batched_values(graph: OpGraph) -> set[str]:
    """Names of the values that carry the batch: graph inputs and everything computed from them."""
    batched = {value.name for value in graph.inputs}
    for node in graph.nodes:
        if any(name in batched for name in node.inputs):
            batched.add(node.name)
    return batched


def compute_s(graph: OpGraph, setup: CostSetup, *, num_batch_shards: int) -> float:
    batched = batched_values(graph)
    total = 0.0
    for node in graph.nodes:
        time = setup.compute.node_time(node)
        total += time.scaled(1 / num_batch_shards).total_s if node.name in batched else time.total_s
    return total


def optimizer_step_s(num_params: float, setup: CostSetup) -> float:
    """The optimizer step over ``num_params`` parameters, memory-bound. On a device with a
    kernel model (the GPU presets), as the runtime's optimizer runs (:mod:`planner.costing.runtime_profiles`): its
    bytes per parameter at the streaming bandwidth. Elsewhere (CPU devices, whose host overheads ``plan calibrate``
    fits with this term) an elementwise update: read and write weights and state, read gradients. The host calls
    per parameter tensor are left out (:mod:`planner.costing.runtime_profiles` says why)."""
    device = setup.cluster.device
    bandwidth = device.memory_bandwidth * device.memory_efficiency
    cost = setup.runtime.optimizer_cost(setup.optimizer) if device.kernels is not None else None
    if cost is None:
        per_param = optimizer_bytes(setup.optimizer)
        return num_params * (2 * (per_param.weights + per_param.state) + per_param.grads) / bandwidth
    return num_params * cost.bytes_per_param / bandwidth


def replica_memory(
    graph: OpGraph,
    setup: CostSetup,
    *,
    num_devices: int,
    grads_in_tape: bool = True,
    weight_shards: float = 1,
    state_shards: float = 1,
    grad_shards: float = 1,
    extra: Mapping[str, tuple[float, float]] | None = None,
) -> StageMemory:
    """One data-parallel replica's memory (:mod:`planner.costing.stage_memory`) over ``num_devices`` devices,
    ``graph`` at the whole batch: weights and optimizer state (split ``weight_shards`` / ``state_shards`` ways),
    and the activations' timeline at ``1/d`` of the batch with the loss on the replica's outputs; the gradients
    (split ``grad_shards`` ways) made in the backward when ``grads_in_tape``, else in the state; ``extra``: node ->
    bytes it holds while it runs and while its backward runs (FSDP's, :func:`planner.costing.zero.fsdp_node_bytes`)."""
    per = optimizer_bytes(setup.optimizer)
    itemsize, share, fused = setup.activation_itemsize, 1.0 / num_devices, not setup.cluster.device.is_cpu()
    grad_bytes = per.grads / grad_shards
    nodes = replica_node_bytes(
        graph,
        batched=batched_values(graph),
        num_batch_shards=num_devices,
        fused=fused,
        activation_itemsize=itemsize,
        param_grad_bytes=grad_bytes if grads_in_tape else 0.0,
    )
    for name, (transient, backward) in (extra or {}).items():
        nodes[name] = replace(nodes[name], transient=transient, backward=backward)
    inputs = {
        v.name: (v.meta.numel * itemsize if itemsize and v.meta.is_floating else v.meta.nbytes) * share
        for v in graph.inputs
    }
    loss = loss_bytes(graph, per_output_element=setup.loss_bytes_per_output_element, share=share)
    tape = stage_tape(
        graph,
        nodes,
        grads=grad_values(graph),
        inputs=inputs,
        loss_bytes=loss,
        activation_itemsize=itemsize,
        fused=fused,
    )
    peak = activation_peak(tape)
    state = graph.num_params * (
        per.weights / weight_shards + per.state / state_shards + (0.0 if grads_in_tape else grad_bytes)
    )
    return StageMemory(
        state_bytes=state, kept_bytes=peak.kept_bytes, peak_bytes=peak.peak_bytes, end_bytes=peak.end_bytes
    )


def ddp_bucket_bytes(graph: OpGraph, setup: CostSetup, *, num_devices: int) -> float:
    """DDP's gradient buckets (``gradient_as_bucket_view=False``, torch's default: each gradient is copied into
    a bucket of its own, kept for the whole run): one more gradient of every parameter, on several devices."""
    return graph.num_params * optimizer_bytes(setup.optimizer).grads if num_devices > 1 else 0.0


def data_parallel_memory_bytes(graph: OpGraph, setup: CostSetup, *, num_devices: int) -> float:
    """Bytes per device of the pure data-parallel plan (``graph`` at the whole batch): one replica's memory
    (:func:`replica_memory`) and DDP's gradient buckets (:func:`ddp_bucket_bytes`)."""
    return replica_memory(graph, setup, num_devices=num_devices).total_bytes + ddp_bucket_bytes(
        graph, setup, num_devices=num_devices
    )


def model_tflops_per_device(graph: OpGraph, *, step_time_s: float, num_devices: int) -> float:
    return (graph.flops_fwd + graph.flops_bwd) / step_time_s / num_devices / 1e12


def mfu(graph: OpGraph, setup: CostSetup, *, step_time_s: float, num_devices: int) -> float:
    device = setup.cluster.device
    peak = device.peak("bfloat16" if device.mixed_precision else "float32")
    return model_tflops_per_device(graph, step_time_s=step_time_s, num_devices=num_devices) * 1e12 / peak


def check_fits(estimate: Estimate, setup: CostSetup, *, what: str) -> None:
    """Raise the user-facing "does not fit" error when the plan needs more memory than allowed."""
    if estimate.memory_per_device_bytes > setup.memory_budget_bytes:
        raise AutoplanError(
            f"does not fit: {what} needs {estimate.memory_per_device_bytes / GIB:.1f} GiB per device, "
            f"the budget is {setup.describe_budget()}"
        )


def shared_params(stages: Sequence[Stage], graph: OpGraph) -> list[str]:
    """Parameters read by nodes of more than one stage (tied weights), in graph order."""
    params = set(graph.param_names)
    readers: dict[str, set[int]] = {}
    for position, stage in enumerate(stages):
        for name in stage.nodes:
            for value in graph.node(name).inputs:
                if value in params:
                    readers.setdefault(value, set()).add(position)
    return [name for name in graph.param_names if len(readers.get(name, ())) > 1]


def shared_param_sync_s(stages: Sequence[Stage], graph: OpGraph, setup: CostSetup) -> float:
    """Summing tied weights' gradients over the stages that read them: an all-reduce per parameter."""
    names = shared_params(stages, graph)
    if not names:
        return 0.0
    cluster = setup.cluster
    link = cluster.link_between(list(range(cluster.num_devices)))
    grad_bytes = optimizer_bytes(setup.optimizer).grads
    return sum(
        all_reduce_s(graph.value(name).meta.numel * grad_bytes, num_devices=cluster.num_devices, link=link)
        for name in names
    )
