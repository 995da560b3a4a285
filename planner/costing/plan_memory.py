"""A plan stage's memory per device from the strategies it stores (:mod:`planner.costing.stage_memory`'s parts).

:func:`sharded_stage_memory` reads every node of a stage as the simulator does
(:func:`planner.costing.stage_work.stage_strategies`, priced by :func:`planner.costing.node_cost.node_cost`) and
builds the stage's tape at the microbatch size (:class:`~planner.costing.stage_memory.NodeBytes` per node):

* a node's outputs at their local size (the first output's local share applied to all of them), its dropout
  mask as the node cost charges it, its parameters' gradients at their local size (``1/z`` of them at ZeRO
  level ≥ 2 over ``z`` replicas) made in its backward when the step has one microbatch, and the resharded copy
  of every input whose producer's stored output spec differs from the one the node reads (DTensor's
  ``redistribute`` returns a new tensor);
* the stage's inputs at the size their first reader reads them (the batch, or what the previous stage sent:
  those need a gradient, which goes back), and its outputs, which the runner holds until the microbatch's
  backward ends; a DTensor stage gathers each output whole first (``StageSharding.leave``: a replicated copy of
  every sharded output, ``gathered_output_bytes``), and the last stage's loss reads the whole outputs — or, when
  the model's outputs are batch-major (:func:`planner.plan.stage.loss_row_axes`), the last stage gathers each output
  to its ``1/n`` of the rows and the loss reads those (``n``: :meth:`~planner.costing.setup.CostSetup.loss_rows`); under
  a runtime that keeps each rank's share (``RuntimeProfile.local_outputs``: Megatron-LM) nothing is gathered and
  the loss reads the rank's share (:func:`_loss_bytes`); a stage that sends its values to the next as shards
  (:func:`planner.plan.stage.sends_shards`) keeps the shard each crosses in (:func:`planner.plan.stage.boundary_spec`:
  its own, less any split the axes do not divide evenly);
* a node the tensor-parallel executor runs on whole inputs (convolutions, batch and group normalization:
  :func:`runs_whole`): its split activation inputs gathered whole (kept when it saves them), its output made
  whole (a transient) and copied out to the planned spec (its local size), and its backward on whole tensors
  (the output's gradient gathered whole and whole input gradients, while it runs);
* a stage run as DDP (:func:`planner.costing.stage_work.runs_as_ddp`) on plain tensors: no copies, its rows
  split over the replicas, the loss on its rows, and DDP's gradient buckets held
  (:func:`planner.costing.estimate.ddp_bucket_bytes`).

Under a runtime whose pipeline stages keep one receive buffer per microbatch for what they receive,
activations forward and gradients back (``RuntimeProfile.kept_receive_buffers``: ``torch.distributed.pipelining``'s
stock stages allocate them once and keep them), a stage holds the activations of the microbatches not in flight
and every output gradient (:func:`_receive_buffers`, ``held``). Megatron-LM and our executors
(:mod:`executors.parallel.receive_buffers`) allocate what a stage receives per microbatch: nothing held.

On a DTensor stage of several devices the gradient buckets (:mod:`executors.parallel.grad_sync`) copy every gradient
that syncs over a mesh axis once more at the end of the last backward (``StageMemory.sync_bytes``).

State: the nodes' ``state_bytes`` (weights, gradients, optimizer state at their shard counts and the stage's
ZeRO level), less the gradients the tape makes when there is one microbatch.

:func:`layer_memory` reads the same tape on one layer for the stage DP's layer tables
(:mod:`planner.inter.layer_costs`): what it holds beyond the intra-op problem's per-node figures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from cost_models.memory import kept_under_recompute, optimizer_bytes, saved_inputs, zero_shards
from cost_models.memory_timeline import Tape, activation_peak
from planner.costing.estimate import ddp_bucket_bytes, replica_memory
from planner.costing.node_cost import NodeCost, node_cost
from planner.costing.setup import CostSetup
from planner.costing.stage_memory import (
    NodeBytes,
    StageMemory,
    aliases,
    grad_values,
    loss_bytes,
    param_owners,
    stage_tape,
)
from planner.costing.stage_work import stage_strategies
from planner.ir.graph import OpGraph, OpNode, ValueKind, subgraph
from planner.ir.op_kinds import BATCH_STATISTICS, WHOLE_UNDER_DTENSOR
from planner.plan import Stage
from planner.plan.stage import sent_spec
from planner.sharding.specs import REPLICATE, ShardingSpec, StageMesh
from planner.sharding.strategies import NodeStrategy


def sharded_stage_memory(
    stage: Stage,
    graph: OpGraph,
    setup: CostSetup,
    *,
    in_flight: int,
    num_microbatches: int,
    last: bool,
    data_inputs: frozenset[str],
    ddp: bool,
    pipeline: bool = False,
    sends_shards: bool = False,
) -> StageMemory:
    """The memory of one device of ``stage`` (module docstring); ``graph`` at the microbatch size (the whole graph
    or the stage's part); ``last``: the stage computes the model's outputs and runs the loss; ``data_inputs``:
    the model's inputs (no gradient); ``ddp``: the stage runs as DDP (a one-stage plan: :func:`runs_as_ddp`);
    ``pipeline``: a stage of a pipeline of several, which keeps a receive buffer per microbatch; ``sends_shards``: it
    sends what it computes to the next stage as shards (:func:`planner.plan.stage.sends_shards`)."""
    grads_in_tape = num_microbatches == 1
    if ddp:  # plain tensors on each replica's rows, whatever the records split
        local = subgraph(graph, list(stage.nodes))
        replica = replica_memory(local, setup, num_devices=len(stage.devices), grads_in_tape=grads_in_tape)
        return replace(replica, held_bytes=ddp_bucket_bytes(local, setup, num_devices=len(stage.devices)))
    context, chosen = stage_strategies(stage, graph, setup)
    local, mesh = context.graph, context.mesh
    nodes, state, synced = _node_bytes(local, chosen, setup, mesh, zero=stage.zero, grads_in_tape=grads_in_tape)
    inputs = _input_bytes(local, chosen, mesh)
    needs = frozenset(name for name in inputs if name not in data_inputs and local.value(name).meta.is_floating)
    several = len(stage.devices) > 1
    gathers = several and not setup.runtime.local_outputs
    rows = setup.loss_rows(stage.mesh_shape, num_microbatches=num_microbatches) if last else 1
    tape = _tape(
        local,
        nodes,
        setup,
        inputs=inputs,
        needs=needs,
        runs=stage.recomputed_runs(),
        several=several,
        loss_bytes=_loss_bytes(local, chosen, mesh, setup, rows=rows) if last else 0.0,
        gathered_output_bytes=_gathered_output_bytes(
            local, chosen, mesh, rows=rows, sends_shards=sends_shards and not last
        )
        if gathers
        else 0.0,
    )
    peak = activation_peak(tape)
    return StageMemory(
        state_bytes=state,
        kept_bytes=peak.kept_bytes,
        peak_bytes=peak.peak_bytes,
        in_flight=in_flight,
        end_bytes=peak.end_bytes,
        sync_bytes=synced if several else 0.0,
        held_bytes=_receive_buffers(local, inputs, needs, m=num_microbatches, in_flight=in_flight, last=last)
        if pipeline and setup.runtime.kept_receive_buffers
        else 0.0,
    )


@dataclass(frozen=True, kw_only=True)
class LayerMemory:
    """What one layer's tape holds beyond the intra-op problem's figures (:func:`layer_memory`)."""

    copies_bytes: float  # resharded copies of inputs its operators save, kept per microbatch in flight
    peak_extra_bytes: float  # one microbatch's peak in the layer beyond what it keeps (its tape's peak − kept)
    sync_bytes: float  # the gradient buckets' copy of its gradients that sync over a mesh axis (several devices)


def layer_memory(
    graph: OpGraph,
    chosen: Mapping[str, NodeStrategy],
    setup: CostSetup,
    mesh: StageMesh,
    *,
    runs: tuple[tuple[str, ...], ...],
    zero: int = 0,
    costs: Mapping[str, NodeCost] | None = None,
) -> LayerMemory:
    """The parts of a stage's memory the intra-op problem does not charge, on the tape of one layer (``graph``, its
    inputs held, at the microbatch size) under ``chosen`` with ``runs`` recomputed, as :func:`sharded_stage_memory`
    charges them on a whole stage: the resharded copies its non-recomputed operators save, the peak of one
    microbatch beyond what it keeps (transients, activation gradients, a recomputed run's activations), and the
    gradient buckets' copy (:class:`~planner.costing.stage_memory.StageMemory`'s ``sync_bytes``). The stage DP adds
    the copies to each layer's activations, the buckets over its layers and the largest peak of them
    (:mod:`planner.inter.search`). ``costs``: each node's cost under ``chosen``, where the caller has them."""
    nodes, _, synced = _node_bytes(graph, chosen, setup, mesh, zero=zero, grads_in_tape=False, costs=costs)
    inputs = _input_bytes(graph, chosen, mesh)
    needs = frozenset(name for name in inputs if graph.value(name).meta.is_floating)
    several = len(mesh.devices) > 1
    tape = _tape(graph, nodes, setup, inputs=inputs, needs=needs, runs=runs, several=several)
    peak = activation_peak(tape)
    recomputed = kept_under_recompute(graph, runs).recomputed if runs else frozenset()
    copies = math.fsum(
        size
        for node in graph.nodes
        if node.name not in recomputed and not aliases(node, inplace_copies=several)
        for position, size in nodes[node.name].copies.items()
        if position in saved_inputs(node)
    )
    return LayerMemory(
        copies_bytes=copies,
        peak_extra_bytes=max(0.0, peak.peak_bytes - peak.kept_bytes),
        sync_bytes=synced if several else 0.0,
    )


def _tape(
    graph: OpGraph,
    nodes: Mapping[str, NodeBytes],
    setup: CostSetup,
    *,
    inputs: Mapping[str, float],
    needs: frozenset[str],
    runs: tuple[tuple[str, ...], ...],
    several: bool,
    loss_bytes: float = 0.0,
    gathered_output_bytes: float = 0.0,
) -> Tape:
    """The tape of ``graph`` (a stage, or one layer) from its nodes' bytes: ``needs``, the inputs whose gradient goes
    back; ``several``: a DTensor stage of several devices (in-place operators write into copies)."""
    return stage_tape(
        graph,
        nodes,
        grads=grad_values(graph, also=needs),
        inputs=inputs,
        input_grads={name: inputs[name] for name in needs},
        loss_bytes=loss_bytes,
        gathered_output_bytes=gathered_output_bytes,
        runs=runs,
        activation_itemsize=setup.activation_itemsize,
        fused=not setup.cluster.device.is_cpu(),
        inplace_copies=several,
    )


def _node_bytes(
    graph: OpGraph,
    chosen: Mapping[str, NodeStrategy],
    setup: CostSetup,
    mesh: StageMesh,
    *,
    zero: int,
    grads_in_tape: bool,
    costs: Mapping[str, NodeCost] | None = None,
) -> tuple[dict[str, NodeBytes], float, float]:
    """Each node's tensors on one device, the stage's state (each parameter once, by its first reader; its
    gradient too unless the tape makes it) and the bytes of the gradients that sync over a mesh axis; ``costs``:
    each node's cost under ``chosen`` where the caller has them (only their output and mask bytes are read)."""
    per = optimizer_bytes(setup.optimizer)
    owners = param_owners(graph)
    found: dict[str, NodeBytes] = {}
    state = synced = 0.0
    for node in graph.nodes:
        strategy = chosen[node.name]
        cost = costs[node.name] if costs is not None else node_cost(node, strategy, setup, mesh, saved=False, zero=zero)
        grads = 0.0
        for name in owners.get(node.name, ()):
            spec = dict(strategy.params).get(name)
            local = graph.value(name).meta.numel / (spec.num_shards(mesh.mesh_shape) if spec is not None else 1)
            axes = dict(strategy.grad_sync_axes).get(name, ())
            weights, grad_shards, states = zero_shards(int(zero), math.prod(mesh.mesh_shape[a] for a in axes))
            grad = local * per.grads / grad_shards
            state += local * (per.weights / weights + per.state / states) + (0.0 if grads_in_tape else grad)
            grads += grad
            synced += grad if axes else 0.0
        whole = mesh.tensor_bytes(node.output)
        share = cost.output_bytes / whole if whole else 1.0
        whole_run = runs_whole(node, strategy, mesh)
        outputs = sum(mesh.tensor_bytes(meta) for meta in node.outputs)
        copies = _copies(graph, node.name, strategy, chosen, mesh, whole=whole_run)
        found[node.name] = NodeBytes(
            output=outputs * share,
            share=share,
            mask=cost.mask_bytes,
            param_grads=grads if grads_in_tape else 0.0,
            copies=copies,
            transient=outputs if whole_run else 0.0,
            # its backward on whole tensors: the output's gradient gathered whole, whole input gradients
            backward=outputs + sum(copies.values()) if whole_run else 0.0,
        )
    return found, state, synced


def _copies(
    graph: OpGraph,
    name: str,
    strategy: NodeStrategy,
    chosen: Mapping[str, NodeStrategy],
    mesh: StageMesh,
    *,
    whole: bool,
) -> dict[int, float]:
    """Input position -> bytes of the resharded copy the node reads, where its producer's spec differs; ``whole``:
    the node runs on whole inputs (:func:`runs_whole`), so every split activation input is gathered whole."""
    node = graph.node(name)
    found = {}
    for position, (value, meta) in enumerate(zip(node.inputs, node.input_metas, strict=True)):
        need = strategy.inputs[position]
        if need is None or graph.value_kind(value) != ValueKind.NODE:
            continue
        produced = chosen[value].output
        if whole and not produced.is_replicated():
            found[position] = mesh.tensor_bytes(meta)
        elif not whole and produced != need:
            found[position] = mesh.local_bytes(meta, need)
    return found


def runs_whole(node: OpNode, strategy: NodeStrategy, mesh: StageMesh) -> bool:
    """Whether the tensor-parallel executor runs ``node`` on whole (all-gathered) inputs and computes its output
    whole before slicing it to the planned spec (:data:`planner.ir.op_kinds.WHOLE_UNDER_DTENSOR`): on a stage of
    several devices, unless (outside batch statistics) every input, parameters included, and the output split at
    most the batch dim and alike, when it runs on its local shards."""
    if len(mesh.devices) == 1 or node.op_name not in WHOLE_UNDER_DTENSOR:
        return False
    specs = [spec for spec in (*strategy.operands, *strategy.inputs) if spec is not None] + [strategy.output]
    batch_only = all(placement in (REPLICATE, "S(0)") for spec in specs for placement in spec.placements)
    alike = len({spec.placements for spec in specs}) == 1
    return node.op_name in BATCH_STATISTICS or not (batch_only and alike)


def _input_bytes(graph: OpGraph, chosen: Mapping[str, NodeStrategy], mesh: StageMesh) -> dict[str, float]:
    """The stage's inputs at the size their first reader reads them."""
    found: dict[str, float] = {}
    for node in graph.nodes:
        for position, value in enumerate(node.inputs):
            if graph.value_kind(value) != ValueKind.INPUT or value in found:
                continue
            meta, need = graph.value(value).meta, chosen[node.name].inputs[position]
            size = mesh.local_bytes(meta, need) if need is not None else mesh.tensor_bytes(meta)
            found[value] = size
    return found


def _loss_bytes(
    graph: OpGraph, chosen: Mapping[str, NodeStrategy], mesh: StageMesh, setup: CostSetup, *, rows: int
) -> float:
    """The loss's tensors on the last stage: on the whole outputs (the runner gathers them), on ``1/rows`` of
    them (the rank's rows, :func:`planner.plan.stage.loss_row_axes`), or on each rank's share of them under a
    runtime that keeps it (``RuntimeProfile.local_outputs``: Megatron-LM's)."""
    per_element = setup.loss_bytes_per_output_element
    if not setup.runtime.local_outputs:
        return loss_bytes(graph, per_output_element=per_element) / rows
    shares = [
        graph.node(name).output.numel / chosen[name].output.num_shards(mesh.mesh_shape)
        for name in dict.fromkeys(graph.outputs)
        if graph.has_node(name) and graph.node(name).output.is_floating
    ]
    return per_element * sum(shares)


def _gathered_output_bytes(
    graph: OpGraph, chosen: Mapping[str, NodeStrategy], mesh: StageMesh, *, rows: int = 1, sends_shards: bool = False
) -> float:
    """The copies the runner makes of a DTensor stage's sharded outputs: whole (``StageSharding.leave``), or
    ``1/rows`` of them on the last stage (``StageSharding.leave_rows``, :func:`planner.plan.stage.loss_row_axes`), or
    under ``sends_shards`` each computed output's shard in the spec it crosses the boundary in
    (:func:`planner.plan.stage.sent_spec`)."""
    total = 0.0
    for name in dict.fromkeys(graph.outputs):
        if not graph.has_node(name):
            continue
        node = graph.node(name)
        meta, spec = node.output, chosen[name].output
        local = mesh.local_bytes(meta, spec)
        kept = mesh.tensor_bytes(meta) / rows
        sent = sent_spec(node, spec.placements, mesh_shape=mesh.mesh_shape) if sends_shards else None
        if sent is not None:
            kept = mesh.local_bytes(meta, ShardingSpec(sent))
        total += kept - local if local < kept else 0.0
    return total


def _receive_buffers(
    graph: OpGraph, inputs: Mapping[str, float], needs: frozenset[str], *, m: int, in_flight: int, last: bool
) -> float:
    """A pipeline stage's receive buffers, made once per microbatch and kept for the run
    (``torch.distributed.pipelining``): the activations it receives, beyond the ``in_flight`` microbatches' the
    timeline holds as stage inputs, and the gradients of its outputs it receives from the next stage."""
    received = sum(inputs[name] for name in needs)
    outputs = 0.0 if last else sum(graph.node(name).output.nbytes for name in dict.fromkeys(graph.outputs))
    return max(0, m - in_flight) * received + m * outputs
