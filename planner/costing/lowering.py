"""Every plan as a task graph for the simulator (:mod:`cost_models.simulator`).

A plan's nodes are cut into *chunks*: maximal runs of consecutive nodes (graph order) on the
same stage. A pipeline plan has one chunk per stage; an op placement has many. Per microbatch
``i`` each chunk ``c`` gets a forward task ``F(c, i)`` and a backward task ``B(c, i)`` on its
stage's resource (all of the stage's devices), with durations the sums of its nodes' work
(:mod:`planner.costing.stage_work`; recomputation adds the forward of the stage's checkpointed runs again
to ``B`` and keeps only what enters them, ``kept_bytes``; a data-parallel plan under FSDP adds the gathers
its compute waits for, :func:`planner.costing.zero.fsdp_price`). ``F`` allocates the chunk's activations, ``B``
frees them; the stage's model state is its base memory. Where a chunk is a whole stage (pipelines, data
parallelism) its memory is the estimate's (:func:`planner.costing.plan_memory.sharded_stage_memory`,
:func:`planner.costing.zero.fsdp_memory`): the base is the stage's state and what its executor holds (DDP's buckets),
``F`` and ``B`` allocate the microbatch's kept activations and, while they run, its peak above them
(``Chunk.transient_bytes``); the step task holds what the last backward leaves (its gradients with one microbatch) and
the gradient buckets (``Lowered.step_bytes``).
After a stage's last backward one ``step`` task does its gradient
sync and optimizer update plus the device's ``step_overhead_s`` (and, in a pipeline whose stages share a
tied weight, the all-reduce of its gradient over every rank: :func:`planner.costing.estimate.shared_param_sync_s`,
as the estimate charges it). Pure data parallelism
(:func:`planner.costing.stage_work.runs_as_ddp`) is priced as the executor runs it, DDP on plain tensors: no
sharded-operator dispatch, DDP's gradient bucket copies in the step, and its buckets all-reduced on a
communication resource while the last backward runs (:mod:`planner.costing.overlap`: that backward is cut
where each bucket becomes ready, and the step waits for the last bucket). Values crossing stages become
transfer tasks on a link resource per ordered pair of stages, forward for the activation and backward
for its gradient.

* **Pipelines** (``gpipe``, ``1f1b``, and one stage with ``none``): stage ``s`` sends everything
  live across its last node (:func:`planner.ir.layers.boundary_bytes`) to ``s + 1``, over
  ``min(|s|, |s + 1|)`` parallel device pairs on the link joining them, then regroups it inside
  the receiver's node (``latency + bytes / pairs / bandwidth + all-gather``, as the planner's
  boundary cost). With several stages each task also pays half the device's
  ``microbatch_overhead_s`` (the schedule's host work). Each pipeline rank (one resource: its devices and
  memory) runs its tasks in the fixed order of the schedule (:func:`planner.plan.schedules.rank_actions`,
  torch's own orders): GPipe all forwards then all backwards; 1F1B ``min(p − s − 1, m)`` warm-up
  forwards, then one forward one backward, then the backwards; interleaved 1F1B and zero bubble the
  stages ``k ≡ r (mod P)`` of rank ``r`` (``Lowered.stage_groups``) in torch's interleaved order. Under
  zero bubble a backward is two tasks: ``I`` (the backward less its weight gradients; the gradient
  sent back waits for it) and ``W`` (the weight gradients,
  :func:`planner.costing.stage_work.weight_grad_s`), which frees the activations and the output gradients of
  the GEMMs it computes weight gradients for (``Chunk.deferred_bytes``, held from ``I`` to ``W``).
* **Dataflow** (op placements): every crossing edge is its own transfer (point to point on the
  link between the two devices) and each device runs whichever of its tasks became ready first
  (FIFO, as TensorFlow's executor), so microbatches overlap wherever the placement lets them.

:func:`simulate_plan` judges a :class:`~planner.plan.Plan`; an op→device assignment of a placement
problem is lowered by :mod:`planner.baselines.placement.dataflow` with the same pieces (the RL reward). The pieces
(:class:`~planner.costing.lowered_tasks.Lowered`, its chunks) and the task graph built from them live in
:mod:`planner.costing.lowered_tasks`.

Values crossing between chunks (:func:`pipeline_edges`, :func:`dataflow_edges`, :func:`stage_transfer`): a pipeline
sends everything live across a stage's last node to the next stage and its gradient back; an op placement sends each
value to every chunk that reads it, and a floating value's gradient back; a transfer between stages costs
:func:`cost_models.communication.stage_transfer_s`, between placed devices :func:`cost_models.communication.p2p_s`.
Every value at its dtype (floating values at the activation itemsize).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from cost_models.communication import p2p_s, placed_transfer_s
from cost_models.simulator import SimResult, simulate
from planner.costing.compression import EXACT, stage_sync
from planner.costing.estimate import shared_param_sync_s
from planner.costing.lowered_tasks import PIPELINE_SCHEDULES, Chunk, Lowered, build_tasks
from planner.costing.offload import offloaded_casts_s, optimizer_step_s
from planner.costing.overlap import SyncSegment
from planner.costing.plan_memory import sharded_stage_memory
from planner.costing.setup import CostSetup
from planner.costing.stage_memory import StageMemory
from planner.costing.stage_work import NodeWork, runs_as_ddp, stage_node_work
from planner.costing.zero import FsdpPrice, fsdp_memory, fsdp_price, runs_as_fsdp
from planner.ir.graph import OpGraph
from planner.ir.layers import boundary_bytes
from planner.plan import GradSync, Plan, Stage
from planner.plan.schedules import Schedule, in_flight_microbatches
from planner.plan.stage import sends_shards


def simulate_lowered(
    lowered: Lowered, *, record: bool = False, include_transfers: bool = True, include_step: bool = True
) -> SimResult:
    tasks = build_tasks(lowered, include_transfers=include_transfers, include_step=include_step)
    return simulate(tasks, record=record)


def chunks_of(stage_of: Sequence[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for position, stage in enumerate(stage_of):
        if runs and stage_of[runs[-1][-1]] == stage:
            runs[-1].append(position)
        else:
            runs.append([position])
    return runs


def lower_plan(plan: Plan, graph: OpGraph, setup: CostSetup) -> Lowered:
    """``graph`` is the model at the plan's microbatch size (``batch_size / num_microbatches``)."""
    return lower_stages(
        plan.stages,
        graph,
        setup,
        num_microbatches=plan.num_microbatches,
        schedule=plan.schedule,
        zero=plan.zero,
        grad_sync=plan.grad_sync,
    )


def lower_stages(
    plan_stages: Sequence[Stage],
    graph: OpGraph,
    setup: CostSetup,
    *,
    num_microbatches: int,
    schedule: str,
    zero: bool = False,
    grad_sync: GradSync = EXACT,
) -> Lowered:
    """:func:`lower_plan` from a plan's parts (candidates that are not plans yet)."""
    m = num_microbatches
    stages = sorted(plan_stages, key=lambda s: s.index)
    assert [stage.index for stage in stages] == list(range(len(stages))), "stages are numbered 0..S-1"
    work: dict[str, NodeWork] = {}
    ddp, fsdp = runs_as_ddp(stages), runs_as_fsdp(stages)  # plain tensors: DDP, or FSDP at a ZeRO level
    for stage in stages:
        work.update(stage_node_work(stage, graph, setup, ddp=ddp or fsdp))
    fsdp_step = fsdp_price(stages[0], graph, setup, work=work, num_microbatches=m) if fsdp else None
    runs, chunks = _chunks(stages, graph, setup, work, fsdp_step=fsdp_step)
    pipeline = schedule in PIPELINE_SCHEDULES and [c.stage for c in chunks] == list(range(len(stages)))
    if pipeline and len(stages) > 1:  # the schedule's host work per stage and microbatch, half per pass
        half = setup.cluster.device.microbatch_overhead_s / 2
        chunks = tuple(replace(c, fwd_s=c.fwd_s + half, bwd_s=c.bwd_s + half) for c in chunks)
    edges, grad_edges = pipeline_edges(graph, runs, setup) if pipeline else dataflow_edges(graph, runs, setup)
    # tied weights' gradients are summed over every rank after the backward pass
    # (executors.parallel.stages.sync_shared_grads)
    tied_s = shared_param_sync_s(stages, graph, setup) if pipeline and len(stages) > 1 else 0.0
    step_s = [
        math.fsum(work[n].step_s for n in stage.nodes) + setup.cluster.device.step_overhead_s + tied_s
        for stage in stages
    ]
    state_bytes = [math.fsum(work[n].state_bytes for n in stage.nodes) for stage in stages]
    step_bytes: tuple[float, ...] = ()
    if pipeline or ddp or fsdp:  # one chunk per stage: its memory as the estimate charges it (plan_memory)
        state_bytes, step_bytes, chunks = _as_estimated(
            stages, graph, setup, chunks, m=m, ddp=ddp, fsdp=fsdp, schedule=schedule
        )
    if fsdp_step is not None:  # the last reduce-scatters instead of the additive shares
        step_s[0] += fsdp_step.tail_s - math.fsum(work[n].zero_step_s for n in stages[0].nodes)
        if stages[0].offload:  # the optimizer on the CPU instead of the device's (planner.costing.offload)
            own = {n: work[n] for n in stages[0].nodes}
            step_s[0] += optimizer_step_s(stages[0], graph, setup, work=own) - optimizer_step_s(
                replace(stages[0], offload=False), graph, setup, work=own
            )
            step_s[0] += offloaded_casts_s(stages[0], graph, setup)  # the device's weight casts stay
    synced = stages if (pipeline or ddp) and not fsdp else []
    segments = _bucket_syncs(synced, graph, setup, work, step_s, state_bytes, grad_sync=grad_sync, ddp=ddp)
    homes = list(dict.fromkeys(stage.devices for stage in stages))  # pipeline ranks, in stage order
    return Lowered(
        stage_groups=tuple(homes.index(stage.devices) for stage in stages) if len(homes) < len(stages) else (),
        num_devices=setup.cluster.num_devices,
        stage_devices=tuple(stage.devices for stage in stages),
        state_bytes=tuple(state_bytes),
        step_bytes=step_bytes,
        step_s=tuple(step_s),
        chunks=chunks,
        edges=edges,
        grad_edges=grad_edges,
        schedule=schedule if pipeline else Schedule.DATAFLOW,
        num_microbatches=m,
        transfer_s=stage_transfer(setup, [stage.devices for stage in stages], pipeline=pipeline),
        totals_s={
            key: math.fsum(getattr(w, key) for w in work.values()) for key in ("compute_s", "comm_s", "reshard_s")
        }
        | {"step_s": math.fsum(work[n].step_s for n in stages[0].nodes)},
        sync_segments=segments,
    )


def _chunks(
    stages: Sequence[Stage],
    graph: OpGraph,
    setup: CostSetup,
    work: dict[str, NodeWork],
    *,
    fsdp_step: FsdpPrice | None,
) -> tuple[list[list[int]], tuple[Chunk, ...]]:
    """The runs of consecutive nodes on one stage (node positions) and their chunks, with FSDP's gathers the compute
    waits for, on average per microbatch."""
    stage_of = {name: stage.index for stage in stages for name in stage.nodes}
    order = [stage_of[node.name] for node in graph.nodes]
    runs = chunks_of(order)
    chunks = tuple(_chunk(graph, run, order[run[0]], work) for run in runs)
    if fsdp_step is not None:
        chunks = tuple(
            replace(c, fwd_s=c.fwd_s + fsdp_step.forward_wait_s, bwd_s=c.bwd_s + fsdp_step.backward_wait_s)
            for c in chunks
        )
    return runs, chunks


def _as_estimated(
    stages: Sequence[Stage],
    graph: OpGraph,
    setup: CostSetup,
    chunks: tuple[Chunk, ...],
    *,
    m: int,
    ddp: bool,
    fsdp: bool,
    schedule: str,
) -> tuple[list[float], tuple[float, ...], tuple[Chunk, ...]]:
    """(state bytes, step bytes, chunks) with each stage's memory as the estimate charges it (one chunk per stage):
    its state and what its executor holds, what it holds through its step, its kept activations and peak above.
    A pipeline stage's receive buffers (held all step) are those of the microbatches not in flight at its peak, as
    the estimate counts them (:func:`_peak_in_flight`): the in-flight ones are in their kept activations."""
    memories = [
        _stage_memory(
            stage,
            graph,
            setup,
            m=m,
            last=s == len(stages) - 1,
            fsdp=fsdp,
            ddp=ddp,
            pipeline=len(stages) > 1,
            in_flight=_peak_in_flight(schedule, num_stages=len(stages), stage=s, m=m),
            sends_shards=sends_shards([stage.mesh_shape for stage in stages], s),
        )
        for s, stage in enumerate(stages)
    ]
    state_bytes = [memory.state_bytes + memory.held_bytes for memory in memories]
    step_bytes = tuple(memory.end_bytes + memory.sync_bytes for memory in memories)
    chunks = tuple(
        replace(
            c,
            activation_bytes=memories[c.stage].kept_bytes,
            transient_bytes=max(0.0, memories[c.stage].peak_bytes - memories[c.stage].kept_bytes),
        )
        for c in chunks
    )
    return state_bytes, step_bytes, chunks


def _bucket_syncs(
    stages: Sequence[Stage],
    graph: OpGraph,
    setup: CostSetup,
    work: dict[str, NodeWork],
    step_s: list[float],
    state_bytes: list[float],
    *,
    grad_sync: GradSync,
    ddp: bool,
) -> dict[int, tuple[SyncSegment, ...]]:
    """Each of ``stages``' gradient buckets in its last backward instead of the additive shares: ``step_s`` and
    ``state_bytes`` updated in place, the buckets returned by stage (:func:`planner.costing.compression.stage_sync`)."""
    segments: dict[int, tuple[SyncSegment, ...]] = {}
    for s, stage in enumerate(stages):
        sync = stage_sync(stage, graph, {n: work[n].bwd_s for n in stage.nodes}, setup, grad_sync=grad_sync, ddp=ddp)
        if sync.segments:
            step_s[s] += sync.amortised_s - math.fsum(work[n].grad_sync_s for n in stage.nodes)
            # a parameter server: the busiest server runs its shard's share of the optimizer step
            step_s[s] -= (1.0 - sync.optimizer_share) * math.fsum(
                work[n].step_s - work[n].grad_sync_s for n in stage.nodes
            )
            state_bytes[s] += sync.state_bytes
            segments[s] = sync.segments
    return segments


def _peak_in_flight(schedule: str, *, num_stages: int, stage: int, m: int) -> int:
    """The microbatches stage ``stage`` holds at its peak under GPipe and 1F1B, as the estimate prices them
    (:func:`planner.plan.schedules.in_flight_microbatches`); 1 under the schedules whose estimate is this replay."""
    if schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B):
        return in_flight_microbatches(schedule, num_stages=num_stages, stage=stage, m=m)
    return 1


def _stage_memory(
    stage: Stage,
    graph: OpGraph,
    setup: CostSetup,
    *,
    m: int,
    last: bool,
    fsdp: bool,
    ddp: bool,
    pipeline: bool,
    in_flight: int = 1,
    sends_shards: bool = False,
) -> StageMemory:
    """A pipeline stage's (or a data-parallel plan's) memory parts, as the estimate charges them: FSDP's through
    :func:`planner.costing.zero.fsdp_memory`, any other stage's through
    :func:`planner.costing.plan_memory.sharded_stage_memory`."""
    if fsdp:
        return fsdp_memory(stage, graph, setup, num_microbatches=m)
    data = frozenset(value.name for value in graph.inputs)
    memory = sharded_stage_memory(
        stage,
        graph,
        setup,
        in_flight=in_flight,
        num_microbatches=m,
        last=last,
        data_inputs=data,
        ddp=ddp,
        pipeline=pipeline,
        sends_shards=sends_shards,
    )
    return replace(memory, in_flight=1)  # the replay holds the in-flight microbatches' activations itself


def _chunk(graph: OpGraph, run: list[int], stage: int, work: dict[str, NodeWork]) -> Chunk:
    """A run of one stage's nodes: its forward, its backward with the recomputed forward of its checkpointed
    nodes, and what it keeps for backward (stage_work's ``kept_bytes``)."""
    nodes = [work[graph.nodes[p].name] for p in run]
    fwd, bwd = math.fsum(w.fwd_s for w in nodes), math.fsum(w.bwd_s + w.recompute_s for w in nodes)
    deferred = math.fsum(w.output_bytes for w in nodes if w.weight_grad_s > 0)  # what W reads besides the inputs
    return Chunk(
        stage=stage,
        fwd_s=fwd,
        bwd_s=bwd,
        activation_bytes=math.fsum(w.kept_bytes for w in nodes),
        weight_grad_s=math.fsum(w.weight_grad_s for w in nodes),
        deferred_bytes=deferred,
    )


def simulate_plan(plan: Plan, graph: OpGraph, setup: CostSetup, *, record: bool = False) -> SimResult:
    """The simulated step of ``plan``; ``graph`` at its microbatch size, ``setup`` the plan's cost setup."""
    return simulate_lowered(lower_plan(plan, graph, setup), record=record)


def _value_bytes(setup: CostSetup, meta) -> float:
    itemsize = setup.activation_itemsize
    return float(meta.numel * itemsize if itemsize and meta.is_floating else meta.nbytes)


Edges = dict[tuple[int, int], float]


def pipeline_edges(graph: OpGraph, runs: list[list[int]], setup: CostSetup) -> tuple[Edges, Edges]:
    """Bytes forward and gradient bytes back across each stage boundary, every value at its dtype."""
    itemsize = setup.activation_itemsize
    forward = boundary_bytes(graph, activation_itemsize=itemsize)
    backward = boundary_bytes(graph, activation_itemsize=itemsize, gradients=True)
    cuts = [(c, run[-1]) for c, run in enumerate(runs[:-1])]
    return (
        {(c, c + 1): float(forward[k]) for c, k in cuts if forward[k] > 0},
        {(c, c + 1): float(backward[k]) for c, k in cuts if backward[k] > 0},
    )


def dataflow_edges(graph: OpGraph, runs: list[list[int]], setup: CostSetup) -> tuple[Edges, Edges]:
    chunk_of = {graph.nodes[p].name: c for c, run in enumerate(runs) for p in run}
    sent: dict[tuple[str, int], tuple[float, bool]] = {}
    for node in graph.nodes:
        for name, meta in zip(node.inputs, node.input_metas, strict=True):
            if name in chunk_of and chunk_of[name] != chunk_of[node.name]:
                sent[name, chunk_of[node.name]] = (_value_bytes(setup, meta), meta.is_floating)
    forward: Edges = {}
    backward: Edges = {}
    for (name, c), (num_bytes, floating) in sent.items():
        key = (chunk_of[name], c)
        forward[key] = forward.get(key, 0.0) + num_bytes
        if floating:
            backward[key] = backward.get(key, 0.0) + num_bytes
    return forward, backward


def stage_transfer(setup: CostSetup, devices: list[tuple[int, ...]], *, pipeline: bool) -> Callable:
    cluster = setup.cluster

    def transfer_s(a: int, b: int, num_bytes: float) -> float:
        if num_bytes <= 0:
            return 0.0
        if not pipeline:
            return p2p_s(num_bytes, link=cluster.link_between([devices[a][0], devices[b][0]]))
        return placed_transfer_s(num_bytes, cluster=cluster, sender=devices[a], receiver=devices[b])

    return transfer_s
