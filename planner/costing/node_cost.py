"""What one node costs under one sharding strategy: seconds per microbatch, seconds per step, bytes.

The intra-op ILP (:mod:`planner.intra.stage_problem`) prices every strategy of every node with
:func:`node_cost`; the simulator (:mod:`planner.costing.stage_work`) prices the one strategy a plan stores
with the same function, so what was searched and what is judged are one cost::

    compute_s = t_v(fwd + bwd) / shards(s) + h · passes_v + c_v     compute — cost_models.compute
    comm_s    = the strategy's own collectives (NodeStrategy.comm_s)
    forward_s = t_v(fwd) / shards(s) + h + comm_s / 2                 the forward pass alone: its share of
                the compute and half the collectives (each has a forward and a backward half), what
                recomputing the node costs (:func:`planner.costing.stage_work.recompute_s`)
    step_s    = grad_sync(s) + optimizer(local params) + h · params_v + c_v   once per step
              grad_sync: per parameter and sync axis its additive share of a bucketed all-reduce
              (cost_models.communication.bucketed_all_reduce_s: sharded stages reduce in buckets too,
              executors.parallel.grad_sync; the estimate and the simulator charge the exact buckets, overlapped
              with the last backward, planner.costing.overlap); when the stage runs as DDP, the same share
              over the stage's devices + DDP_BUCKET_COPIES · gradient bytes / memory bandwidth
              + zero_step: the ZeRO level's collectives once per step (planner.costing.zero.param_terms:
              the all-gather of updated parameters; under FSDP the reduce-scatter replaces the all-reduce)
    zero_comm_s = FSDP's collectives every microbatch at ZeRO levels 2 and 3 (reduce-scatter; all-gathers)
    state_bytes      = model state of v's parameters at their shard counts (planner.costing.setup / memory.py);
                       at ZeRO level z over the sync axes' d replicas: optimizer state / d (z ≥ 1),
                       gradients / d (z ≥ 2), weights / d (z = 3) (cost_models.memory.zero_shards)
    activation_bytes = v's output at its local size, when it is kept for backward, plus a dropout's
                       mask at the local size it is computed in (one byte an element on a GPU, the activation
                       dtype's on a CPU; cost_models.memory.dropout_mask): sequence shards under sequence
                       parallelism, even where the output is then gathered
                       (planner.sharding.sequence_parallel.computed_output), plus what it keeps beyond them
                       (kept_extra_bytes: pooling indices, RNN gates, attention scores under CPU dropout)

``c_v`` (:func:`autocast_cast_s`) is what one of bf16 autocast's casts of a matmul's or convolution's fp32 parameters
costs, under our runtime with ``adam-mixed`` on a device with a kernel model (the GPU presets): the local parameters'
elements × ``AUTOCAST_CAST_BYTES`` (fp32 read, bf16 written; :mod:`planner.costing.runtime_profiles`) at the
streaming bandwidth, plus one kernel's overhead per parameter (0 elsewhere). The forward's cast is paid once per
step: the executor runs the whole step in one autocast region (``executors/training/parallel_model.py``), whose
cache keeps a parameter's bf16 copy for every microbatch (and for recomputation); each microbatch's backward casts
its bf16 weight gradient back to fp32 (the same bytes the other way). The in-place accumulation of the second and
later microbatches' gradients is not priced (:mod:`planner.costing.runtime_profiles`).

``h`` is the device's calibrated ``sharded_op_overhead_s`` on a mesh of more than one device
(:func:`sharded_dispatch_s`: the executor runs such stages on DTensors), 0 on one device and for a
stage run as DDP; ``passes_v`` is 2 when v has floating inputs, else 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cost_models.communication import bucketed_all_reduce_s
from cost_models.memory import (
    attention_dropout_bytes,
    dropout_mask,
    index_bytes,
    model_state_bytes,
    optimizer_bytes,
    rnn_kept_bytes,
    zero_shards,
)
from planner.costing.estimate import DDP_BUCKET_COPIES, optimizer_step_s
from planner.costing.runtime_profiles import autocast_cast_seconds, casts_parameters
from planner.costing.setup import CostSetup
from planner.costing.stage_memory import grad_values as stage_grad_values
from planner.costing.zero import param_terms
from planner.ir.graph import OpGraph, OpNode
from planner.sharding.sequence_parallel import computed_output
from planner.sharding.specs import StageMesh
from planner.sharding.strategies import NodeStrategy, StrategyContext


@dataclass(frozen=True, kw_only=True)
class NodeCost:
    compute_s: float
    comm_s: float
    step_s: float  # gradient sync + optimizer update, per step
    state_bytes: float  # parameters, gradients and optimizer state
    activation_bytes: float  # the output, when it is kept for backward
    forward_s: float = 0.0  # the forward pass of compute_s + comm_s (what recomputation repeats)
    grad_sync_s: float = 0.0  # the gradient-sync part of step_s
    zero_step_s: float = 0.0  # the ZeRO part of step_s beyond grad_sync_s (planner.costing.zero.param_terms)
    zero_comm_s: float = 0.0  # ZeRO collectives every microbatch (FSDP levels 2, 3), not in comm_s
    output_bytes: float = 0.0  # the output at its local size, kept for backward or not
    mask_bytes: float = 0.0  # a dropout's mask, the part of activation_bytes beyond the output
    extra_bytes: float = 0.0  # pooling indices, RNN gates, attention scores: kept_extra_bytes (in activation_bytes)

    @property
    def memory_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes


def grad_values(graph: OpGraph) -> frozenset[str]:
    """Values whose gradient is needed: the parameters and every floating value computed from one."""
    return stage_grad_values(graph)


def strategy_context(graph: OpGraph, setup: CostSetup, mesh: StageMesh) -> StrategyContext:
    """What the sharding rules need to enumerate and price ``graph``'s strategies on ``mesh``."""
    grad_itemsize = 2 if setup.cluster.device.mixed_precision else 4  # bf16 gradients under mixed precision
    return StrategyContext(graph=graph, mesh=mesh, grad_values=grad_values(graph), grad_itemsize=grad_itemsize)


def node_cost(
    node: OpNode,
    strategy: NodeStrategy,
    setup: CostSetup,
    mesh: StageMesh,
    *,
    saved: bool,
    zero: int = 0,
    ddp: bool = False,
) -> NodeCost:
    """The cost of ``node`` under ``strategy`` on ``mesh``; ``saved``: its output is kept for backward; ``zero``:
    the stage's ZeRO level over the parameters' sync axes (planner.costing.zero)."""
    computed = computed_output(strategy, rank=len(node.output.shape))  # before a reduce-scatter or gather
    graph_time = setup.compute.local_time(
        node, shards=strategy.compute_shards, output_shards=computed.shards_per_dim(mesh.mesh_shape)
    )  # t_v / shards(s), or the local share's own shape under a GPU kernel shape model
    output_bytes = mesh.local_bytes(node.output, strategy.output)
    activation = output_bytes if saved else 0.0
    fused = not setup.cluster.device.is_cpu()
    mask = dropout_mask(node, fused=fused)
    mask_bytes = mesh.local_bytes(mask, computed) if mask is not None else 0.0
    extra_bytes = kept_extra_bytes(node, mesh, output_bytes=output_bytes, fused=fused)
    activation += mask_bytes + extra_bytes
    state, local_params, zero_step_s, zero_comm_s = _param_costs(node, strategy, setup, mesh, zero=zero, ddp=ddp)
    dispatch_s = 0.0 if ddp else sharded_dispatch_s(setup, mesh=mesh)
    grad_sync_s = _ddp_share_s(node, strategy, setup, mesh) if ddp else strategy.grad_sync_s
    if zero and (ddp or zero >= 2):  # FSDP's reduce-scatters replace the all-reduce
        grad_sync_s = 0.0
    cast_s = autocast_cast_s(node, strategy, setup, mesh)  # the forward's once per step, the backward's per microbatch
    step_s = grad_sync_s + zero_step_s + optimizer_step_s(local_params, setup) + dispatch_s * len(strategy.params)
    step_s += cast_s
    if ddp and math.prod(mesh.mesh_shape) > 1:  # DDP copies each gradient into its bucket and back (one device: no DDP)
        device = setup.cluster.device
        grad_bytes = local_params * optimizer_bytes(setup.optimizer).grads
        step_s += DDP_BUCKET_COPIES * grad_bytes / (device.memory_bandwidth * device.memory_efficiency)
    passes = 2 if any(meta.is_floating for meta in node.input_metas) else 1
    return NodeCost(
        compute_s=graph_time.total_s + dispatch_s * passes + cast_s,
        comm_s=strategy.comm_s,
        step_s=step_s,
        state_bytes=state,
        activation_bytes=activation,
        forward_s=graph_time.fwd_s + dispatch_s + strategy.comm_s / 2,
        grad_sync_s=grad_sync_s,
        zero_step_s=zero_step_s,
        zero_comm_s=zero_comm_s,
        output_bytes=output_bytes,
        mask_bytes=mask_bytes,
        extra_bytes=extra_bytes,
    )


def autocast_cast_s(node: OpNode, strategy: NodeStrategy, setup: CostSetup, mesh: StageMesh) -> float:
    """Seconds of one of bf16 autocast's casts of ``node``'s fp32 parameters (the forward's, once per step; the
    backward's cast of their gradients, per microbatch), at their local size under ``strategy`` (module docstring:
    ``c_v``; :func:`planner.costing.runtime_profiles.autocast_cast_seconds`)."""
    device = setup.cluster.device
    if not strategy.params or not casts_parameters(
        node.kind, runtime=setup.runtime, optimizer=setup.optimizer, device=device
    ):
        return 0.0
    numel = sum(_param_numel(node, name) / spec.num_shards(mesh.mesh_shape) for name, spec in strategy.params)
    return autocast_cast_seconds(numel=numel, num_params=len(strategy.params), device=device)


def _param_costs(
    node: OpNode, strategy: NodeStrategy, setup: CostSetup, mesh: StageMesh, *, zero: int, ddp: bool
) -> tuple[float, float, float, float]:
    """(state bytes, local parameters the optimizer updates, ZeRO seconds per step, ZeRO seconds per microbatch) of
    ``node``'s parameters under ``strategy``: each sharded by its spec and, at ZeRO level ``zero``, over its
    gradient sync axes (:func:`cost_models.memory.zero_shards`, :func:`planner.costing.zero.param_terms`)."""
    state = 0.0
    sync_axes = dict(strategy.grad_sync_axes)
    local_params = 0.0
    zero_step_s = zero_comm_s = 0.0
    for name, spec in strategy.params:
        numel = _param_numel(node, name)
        shards = spec.num_shards(mesh.mesh_shape)
        if not zero:
            state += model_state_bytes(
                numel, optimizer=setup.optimizer, weight_shards=shards, grad_shards=shards, state_shards=shards
            )
            local_params += numel / shards
            continue
        axes = sync_axes.get(name, ())
        weight, grad, optimizer_state = zero_shards(int(zero), math.prod(mesh.mesh_shape[axis] for axis in axes))
        state += model_state_bytes(
            numel,
            optimizer=setup.optimizer,
            weight_shards=shards * weight,
            grad_shards=shards * grad,
            state_shards=shards * optimizer_state,
        )
        local_params += numel / (shards * optimizer_state)
        terms = param_terms(int(zero), local_numel=numel / shards, setup=setup, mesh=mesh, axes=axes, plain=ddp)
        zero_step_s, zero_comm_s = zero_step_s + terms.step_s, zero_comm_s + terms.per_microbatch_s
    return state, local_params, zero_step_s, zero_comm_s


def kept_extra_bytes(node: OpNode, mesh: StageMesh, *, output_bytes: float, fused: bool) -> float:
    """What ``node`` keeps for backward beyond its output and dropout mask, at its local share: a max pooling's
    indices, an RNN's per-step gates, an attention's score matrices under dropout without a fused kernel
    (:func:`cost_models.memory.index_bytes`, :func:`~cost_models.memory.rnn_kept_bytes`,
    :func:`~cost_models.memory.attention_dropout_bytes`)."""
    itemsize = mesh.activation_itemsize
    whole = index_bytes(node) + rnn_kept_bytes(node, activation_itemsize=itemsize)
    whole += attention_dropout_bytes(node, fused=fused, itemsize=itemsize)
    if not whole:
        return 0.0
    full = mesh.tensor_bytes(node.output)
    return whole * (output_bytes / full if full else 1.0)


def _ddp_share_s(node: OpNode, strategy: NodeStrategy, setup: CostSetup, mesh: StageMesh) -> float:
    """The node's parameters' additive share of DDP's bucketed all-reduce over the stage's devices."""
    link = setup.cluster.link_between(mesh.devices)
    grad_bytes = optimizer_bytes(setup.optimizer).grads
    return sum(
        bucketed_all_reduce_s(_param_numel(node, name) * grad_bytes, num_devices=len(mesh.devices), link=link)
        for name, _ in strategy.params
    )


def sharded_dispatch_s(setup: CostSetup, *, mesh: StageMesh) -> float:
    """Host time of one operator call on sharded tensors: 0 on a one-device stage (plain tensors)."""
    return 0.0 if len(mesh.devices) == 1 else setup.cluster.device.sharded_op_overhead_s


def _param_numel(node: OpNode, name: str) -> int:
    return next(meta.numel for value, meta in zip(node.inputs, node.input_metas, strict=True) if value == name)
