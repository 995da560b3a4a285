"""Step time, memory and throughput of a plan under one cost model, in seconds and bytes.

A single-stage plan over ``d`` data-parallel devices (:func:`data_parallel_estimate`)::

    step_time_s  = compute_s + grad_sync_s + bucket_copy_s + optimizer_s + step_overhead_s
    compute_s    = Σ_v  t_v(fwd + bwd) scaled by 1/d for batch-carrying nodes   (compute.py);
                   with measured times, Σ_v t_v of the graph at the batch of one replica
    grad_sync_s  = the part of DDP's bucketed gradient all-reduce (one all-reduce per bucket, packed as DDP
                   packs them, over d devices and the slowest link) not hidden behind the backward pass
                   (:mod:`planner.costing.overlap`); the hidden part is reported as grad_sync_overlapped_s
    bucket_copy_s = 4 · gradient bytes / memory bandwidth: DDP copies gradients into its buckets and
                   back (``DDP_BUCKET_COPIES``; the executor runs pure data parallelism with DDP)
    optimizer_s  = num_params · (2·(weight + state bytes) + grad bytes) / memory bandwidth
    step_overhead_s = the device's calibrated host work once per step (every plan pays it)
    memory_bytes = weights and optimizer state (memory.py, by optimizer) + DDP's gradient buckets (one more
                   gradient of every parameter on several devices: :func:`ddp_bucket_bytes`) + the peak of one
                   replica's activations, gradients and loss over its forward and backward at 1/d of the
                   batch (:func:`replica_memory`, :mod:`planner.costing.stage_memory`)

A parameter read in several pipeline stages (a tied embedding) has its gradient summed over every
rank after the backward pass (:func:`executors.stages.sync_shared_grads`), priced by
:func:`shared_param_sync_s`: one all-reduce of the whole gradient per such parameter, over all the
cluster's devices and its slowest link; pipeline plans add it to the step
(:func:`planner.inter.pricing.price_stages`).

Gradient synchronisation overlaps the backward pass where the executor overlaps it: under DDP (pure data
parallelism) and on sharded stages (their buckets, :mod:`executors.grad_sync`; priced by
:func:`planner.inter.pricing.price_stages`); FSDP's collectives and their overlap are :mod:`planner.costing.zero`'s. Model FLOPs are those of the
captured graph (forward + backward, no recomputation); TFLOP/s per device and model-FLOPs
utilisation (MFU) divide them by step time, device count and the device's peak.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from cost_models.cluster import Link
from cost_models.communication import all_reduce_s, ddp_all_reduce_s
from cost_models.memory import optimizer_bytes
from cost_models.memory_timeline import activation_peak
from cost_models.units import GIB
from planner.costing.overlap import ddp_segments, exposed_sync_s
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


def ddp_grad_sync_s(graph: OpGraph, setup: CostSetup, *, num_devices: int, link: Link) -> float:
    """DDP's gradient all-reduce of every parameter, one per bucket (parameters reversed, as DDP packs them)."""
    grad_bytes = optimizer_bytes(setup.optimizer).grads
    sizes = [p.meta.numel * grad_bytes for p in reversed(graph.params)]
    return ddp_all_reduce_s(sizes, num_devices=num_devices, link=link)


def backward_s(graph: OpGraph, setup: CostSetup, *, num_batch_shards: int) -> dict[str, float]:
    """Each node's backward seconds, batch-carrying nodes scaled by ``1/num_batch_shards`` (as :func:`compute_s`)."""
    batched = batched_values(graph)
    return {
        node.name: setup.compute.node_time(node).scaled(1 / num_batch_shards if node.name in batched else 1.0).bwd_s
        for node in graph.nodes
    }


def optimizer_step_s(num_params: float, setup: CostSetup) -> float:
    """A memory-bound elementwise update: read and write weights and state, read gradients."""
    per_param = optimizer_bytes(setup.optimizer)
    device = setup.cluster.device
    moved = num_params * (2 * (per_param.weights + per_param.state) + per_param.grads)
    return moved / (device.memory_bandwidth * device.memory_efficiency)


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


def data_parallel_estimate(
    graph: OpGraph, setup: CostSetup, *, devices: tuple[int, ...], replica_graph: OpGraph | None = None
) -> Estimate:
    """``replica_graph``: the graph at one replica's batch, priced as it is instead of ``graph``'s
    batch-carrying nodes scaled by ``1/d`` (for compute models whose times depend on shapes)."""
    num_devices = len(devices)
    per_param = optimizer_bytes(setup.optimizer)
    if replica_graph is not None:
        compute = compute_s(replica_graph, setup, num_batch_shards=1)
    else:
        compute = compute_s(graph, setup, num_batch_shards=num_devices)
    link = setup.cluster.link_between(devices)
    whole_sync = ddp_grad_sync_s(graph, setup, num_devices=num_devices, link=link)
    grad_sync = 0.0
    if num_devices > 1:  # DDP overlaps its buckets with the backward pass (planner.costing.overlap)
        priced = replica_graph if replica_graph is not None else graph
        backward = backward_s(priced, setup, num_batch_shards=1 if replica_graph is not None else num_devices)
        grad_sync = exposed_sync_s(ddp_segments(priced, backward, optimizer=setup.optimizer,
                                                num_devices=num_devices, link=link))  # fmt: skip
    optimizer = optimizer_step_s(graph.num_params, setup)
    device = setup.cluster.device
    grad_bytes = sum(p.meta.numel * per_param.grads for p in graph.params)
    copies = DDP_BUCKET_COPIES if num_devices > 1 else 0  # one device runs without DDP
    bucket_copy = copies * grad_bytes / (device.memory_bandwidth * device.memory_efficiency)
    step = compute + grad_sync + bucket_copy + optimizer + device.step_overhead_s
    memory = replica_memory(graph, setup, num_devices=num_devices).total_bytes + ddp_bucket_bytes(
        graph, setup, num_devices=num_devices
    )
    return Estimate(
        step_time_s=step,
        per_stage_time_s=(step,),
        memory_per_device_bytes=int(memory),
        bubble_fraction=0.0,
        tflops_per_device=model_tflops_per_device(graph, step_time_s=step, num_devices=num_devices),
        mfu=mfu(graph, setup, step_time_s=step, num_devices=num_devices),
        breakdown_s={
            "compute_s": compute,
            "grad_sync_s": grad_sync,
            "grad_sync_overlapped_s": whole_sync - grad_sync,
            "bucket_copy_s": bucket_copy,
            "optimizer_s": optimizer,
        },
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
