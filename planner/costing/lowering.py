"""Every plan as a task graph for the simulator (:mod:`cost_models.simulator`).

A plan's nodes are cut into *chunks*: maximal runs of consecutive nodes (graph order) on the
same stage. A pipeline plan has one chunk per stage; an op placement has many. Per microbatch
``i`` each chunk ``c`` gets a forward task ``F(c, i)`` and a backward task ``B(c, i)`` on its
stage's resource (all of the stage's devices), with durations the sums of its nodes' work
(:mod:`planner.costing.stage_work`; recomputation adds the forward of the stage's checkpointed runs again
to ``B`` and keeps only what enters them, ``kept_bytes``; a data-parallel plan under FSDP adds the gathers
its compute waits for, :func:`planner.costing.zero.fsdp_price`). ``F`` allocates the chunk's activations, ``B`` frees them; the stage's model
state is its base memory. Where a chunk is a whole stage (pipelines, data parallelism) its memory is the
estimate's (:func:`planner.costing.plan_memory.sharded_stage_memory`, :func:`planner.costing.zero.fsdp_memory`):
the base is the stage's state and what its executor holds (DDP's buckets), ``F`` and ``B`` allocate the
microbatch's kept activations and, while they run, its peak above them (``Chunk.transient_bytes``); the step
task holds what the last backward leaves (its gradients with one microbatch) and the gradient buckets
(``Lowered.step_bytes``).
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
problem is lowered by :mod:`planner.baselines.placement.dataflow` with the same pieces (the RL reward).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from cost_models.simulator import SimResult, TaskGraph, simulate
from planner.costing.compression import EXACT, stage_sync
from planner.costing.estimate import shared_param_sync_s
from planner.costing.overlap import SyncSegment
from planner.costing.plan_memory import sharded_stage_memory
from planner.costing.setup import CostSetup
from planner.costing.stage_memory import StageMemory
from planner.costing.stage_work import NodeWork, runs_as_ddp, stage_node_work
from planner.costing.transfers import dataflow_edges, pipeline_edges, stage_transfer
from planner.costing.zero import fsdp_memory, fsdp_price, runs_as_fsdp
from planner.ir.graph import OpGraph
from planner.plan import GradSync, Plan, Stage
from planner.plan.schedules import rank_actions

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble", "none")


@dataclass(frozen=True, kw_only=True)
class Chunk:
    stage: int
    fwd_s: float
    bwd_s: float  # recomputation included
    activation_bytes: float
    weight_grad_s: float = 0.0  # the part of bwd_s a zero-bubble schedule runs as its own W task
    transient_bytes: float = 0.0  # held only while its forward or backward runs: the microbatch's peak above it
    # zero bubble: the output gradients its weight-gradient GEMMs read, held from its I task to its W task
    deferred_bytes: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Lowered:
    num_devices: int
    stage_devices: tuple[tuple[int, ...], ...]
    state_bytes: tuple[float, ...]  # per stage
    step_s: tuple[float, ...]  # per stage
    chunks: tuple[Chunk, ...]  # in graph order
    edges: dict[tuple[int, int], float]  # (chunk from, chunk to) -> bytes per microbatch, forward
    grad_edges: dict[tuple[int, int], float]  # the gradient bytes coming back over the same edges
    schedule: str  # gpipe, 1f1b, none or dataflow
    num_microbatches: int
    transfer_s: Callable[[int, int, float], float]  # (stage from, stage to, bytes) -> seconds
    totals_s: Mapping[str, float] = field(default_factory=dict)  # per microbatch, summed over devices' stages
    # per stage: its gradient buckets in its last backward (planner.costing.overlap; not in step_s)
    sync_segments: Mapping[int, tuple[SyncSegment, ...]] = field(default_factory=dict)
    stage_groups: tuple[int, ...] = ()  # pipeline rank of each stage (stage k on rank k mod P); () = one each
    step_bytes: tuple[float, ...] = ()  # per stage, held during its step: StageMemory's end + sync bytes

    def group_of(self, stage: int) -> int:
        return self.stage_groups[stage] if self.stage_groups else stage


def pipeline_order(schedule: str, *, num_stages: int, stage: int, num_microbatches: int) -> list[tuple[str, int]]:
    """``("F", i)`` / ``("B", i)`` in the order stage ``stage`` of a one-stage-per-rank pipeline runs them."""
    actions = rank_actions(
        schedule, num_ranks=num_stages, virtual_stages=1, num_microbatches=num_microbatches, rank=stage
    )
    return [(kind, i) for _, kind, i in actions]


def build_tasks(lowered: Lowered, *, include_transfers: bool = True, include_step: bool = True) -> TaskGraph:
    """The task graph of a lowered plan; the switches drop transfers or steps (to explain a gap)."""
    graph = TaskGraph(num_devices=lowered.num_devices)
    fixed = lowered.schedule in PIPELINE_SCHEDULES
    num_groups = 1 + max(lowered.group_of(s) for s in range(len(lowered.stage_devices)))
    groups = []
    for g in range(num_groups):  # one resource per pipeline rank: its stages share its devices and memory
        members = [s for s in range(len(lowered.stage_devices)) if lowered.group_of(s) == g]
        groups.append(
            graph.add_resource(
                f"stage {g}" if len(members) == 1 else f"rank {g}",
                devices=lowered.stage_devices[members[0]],
                order="fixed" if fixed else "ready",
                base_memory_bytes=math.fsum(lowered.state_bytes[s] for s in members),
            )
        )
    stages = [groups[lowered.group_of(s)] for s in range(len(lowered.stage_devices))]
    links: dict[tuple[int, int], int] = {}

    def link(a: int, b: int) -> int:
        a, b = lowered.group_of(a), lowered.group_of(b)
        if (a, b) not in links:
            links[a, b] = graph.add_resource(f"link {a}>{b}", order="ready")
        return links[a, b]

    def transfer(name: str, a: int, b: int, num_bytes: float, after: int) -> int:
        seconds = lowered.transfer_s(a, b, num_bytes) if include_transfers else 0.0
        return graph.add_task(name, resource=link(a, b), duration_s=seconds, deps=(after,))

    chunks, m = lowered.chunks, lowered.num_microbatches
    into: list[list[tuple[int, float]]] = [[] for _ in chunks]
    for (u, v), num_bytes in sorted(lowered.edges.items()):
        into[v].append((u, num_bytes))
    forward = {}
    for i in range(m):
        for c, chunk in enumerate(chunks):
            deps = []
            for u, num_bytes in into[c]:
                same = chunks[u].stage == chunk.stage
                deps.append(
                    forward[u, i]
                    if same
                    else transfer(f"F{i} {u}>{c}", chunks[u].stage, chunk.stage, num_bytes, forward[u, i])
                )
            forward[c, i] = graph.add_task(
                f"F{i} c{c}",
                resource=stages[chunk.stage],
                duration_s=chunk.fwd_s,
                deps=deps,
                alloc_bytes=chunk.activation_bytes + chunk.transient_bytes,
                free_bytes=chunk.transient_bytes,
            )
    out: list[list[tuple[int, float]]] = [[] for _ in chunks]
    for u, v in sorted(lowered.edges):
        out[u].append((v, lowered.grad_edges.get((u, v), 0.0)))
    split = lowered.schedule == "zero-bubble"  # I (input gradients, what the stage before waits for), later W
    backward, weight, parts, syncs = {}, {}, {}, {}
    for i in range(m):
        for c in reversed(range(len(chunks))):
            chunk, deps = chunks[c], [forward[c, i]]
            for v, num_bytes in out[c]:
                same = chunks[v].stage == chunk.stage
                deps.append(
                    backward[v, i]
                    if same
                    else transfer(f"B{i} {v}>{c}", chunks[v].stage, chunk.stage, num_bytes, backward[v, i])
                )
            segments = lowered.sync_segments.get(chunk.stage, ()) if i == m - 1 else ()
            if segments and not split:  # the buckets go out while the stage's last backward runs
                parts[c, i], syncs[chunk.stage] = _overlapped_backward(
                    graph, segments, stages[chunk.stage], f"B{i} c{c}", chunk, deps, include_step=include_step
                )
                backward[c, i] = parts[c, i][-1]
                continue
            if split:
                backward[c, i] = graph.add_task(
                    f"I{i} c{c}",
                    resource=stages[chunk.stage],
                    duration_s=chunk.bwd_s - chunk.weight_grad_s,
                    deps=deps,
                    alloc_bytes=chunk.transient_bytes + chunk.deferred_bytes,
                    free_bytes=chunk.transient_bytes,
                )
                weight[c, i] = graph.add_task(
                    f"W{i} c{c}",
                    resource=stages[chunk.stage],
                    duration_s=chunk.weight_grad_s,
                    deps=(backward[c, i],),
                    free_bytes=chunk.activation_bytes + chunk.deferred_bytes,
                )
                continue
            backward[c, i] = graph.add_task(
                f"B{i} c{c}",
                resource=stages[chunk.stage],
                duration_s=chunk.bwd_s,
                deps=deps,
                alloc_bytes=chunk.transient_bytes,
                free_bytes=chunk.activation_bytes + chunk.transient_bytes,
            )
    steps = {}
    for s, resource in enumerate(stages):
        mine = [
            weight.get((c, i), backward[c, i]) for c, chunk in enumerate(chunks) if chunk.stage == s for i in range(m)
        ]
        seconds = lowered.step_s[s] if include_step else 0.0
        if split and lowered.sync_segments.get(s):  # zero bubble: the buckets go out after the last W
            syncs[s] = _syncs_after(graph, lowered.sync_segments[s], after=mine[-1], include_step=include_step)
        at_end = lowered.step_bytes[s] if lowered.step_bytes else 0.0  # what the last backward leaves, the buckets
        steps[s] = graph.add_task(
            f"step s{s}",
            resource=resource,
            duration_s=seconds,
            deps=mine + syncs.get(s, []),
            end_of_step=True,
            alloc_bytes=at_end,
            free_bytes=at_end,
        )
    if fixed:
        _set_pipeline_orders(
            graph, lowered, groups, forward, backward | {("W", c, i): t for (c, i), t in weight.items()}, steps, parts
        )
    return graph


def _overlapped_backward(
    graph: TaskGraph,
    segments: Sequence[SyncSegment],
    resource: int,
    name: str,
    chunk: Chunk,
    deps: list[int],
    *,
    include_step: bool,
) -> tuple[list[int], list[int]]:
    """The last backward of a stage cut where its buckets become ready, and one all-reduce task per bucket
    on a communication resource, one after another (:mod:`planner.costing.overlap`); a lossy choice's
    compression compute runs on the stage's devices before its bucket goes out. Recomputation, when the
    stage recomputes, runs first: the first part takes whatever the segments leave of the chunk's backward."""
    first_extra = max(0.0, chunk.bwd_s - math.fsum(segment.backward_s for segment in segments))
    comm = graph.add_resource(f"{name} sync", order="ready")
    parts: list[int] = []
    syncs: list[int] = []
    for k, segment in enumerate(segments):
        last = k == len(segments) - 1
        parts.append(
            graph.add_task(
                f"{name} part {k}",
                resource=resource,
                duration_s=segment.backward_s + segment.compress_s + (first_extra if k == 0 else 0.0),
                deps=deps if k == 0 else (parts[-1],),
                alloc_bytes=chunk.transient_bytes if k == 0 else 0.0,
                free_bytes=chunk.activation_bytes + chunk.transient_bytes if last else 0.0,
            )
        )
        if segment.all_reduce_s > 0:
            seconds = segment.all_reduce_s if include_step else 0.0
            syncs.append(
                graph.add_task(
                    f"sync bucket {k}",
                    resource=comm,
                    duration_s=seconds,
                    deps=(parts[-1], *syncs[-1:]),
                    end_of_step=True,
                )
            )
    return parts, syncs


def _syncs_after(graph: TaskGraph, segments: Sequence[SyncSegment], *, after: int, include_step: bool) -> list[int]:
    """Every bucket of a stage after its last task (a zero-bubble stage's last W), one after another, the
    compression compute first (:func:`planner.costing.overlap.after_backward_s` with nothing overlapped)."""
    comm = graph.add_resource(f"sync after {after}", order="ready")
    pending = math.fsum(segment.compress_s for segment in segments)
    syncs: list[int] = []
    for k, segment in enumerate(segments):
        if segment.all_reduce_s > 0:
            seconds = segment.all_reduce_s + pending if include_step else 0.0
            syncs.append(
                graph.add_task(
                    f"sync bucket {k}", resource=comm, duration_s=seconds, deps=(after, *syncs[-1:]), end_of_step=True
                )
            )
            pending = 0.0
    return syncs


def _set_pipeline_orders(
    graph: TaskGraph, lowered: Lowered, groups: list[int], forward: dict, backward: dict, steps: dict, parts: dict
) -> None:
    """Each pipeline rank runs its stages' tasks in the schedule's order (:func:`planner.plan.schedules.rank_actions`),
    then its stages' steps. ``backward`` holds ``B``/``I`` tasks by ``(stage, i)``, ``W`` tasks by ``("W", stage, i)``."""
    count = len(lowered.chunks)
    assert [chunk.stage for chunk in lowered.chunks] == list(range(count)), "a pipeline has one chunk per stage"
    schedule = "1f1b" if lowered.schedule == "none" else lowered.schedule
    num_ranks = len(groups)
    virtual = len(lowered.chunks) // num_ranks
    for rank, resource in enumerate(groups):
        tasks = []
        for s, kind, i in rank_actions(
            schedule, num_ranks=num_ranks, virtual_stages=virtual, num_microbatches=lowered.num_microbatches, rank=rank
        ):
            if kind == "F":
                tasks.append(forward[s, i])
            elif kind == "W":
                tasks.append(backward["W", s, i])
            else:
                tasks.extend(parts.get((s, i), [backward[s, i]]))
        mine = [steps[s] for s in range(len(lowered.chunks)) if lowered.group_of(s) == rank]
        graph.set_order(resource, [*tasks, *mine])


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
    stage_of = {name: stage.index for stage in stages for name in stage.nodes}
    work: dict[str, NodeWork] = {}
    ddp, fsdp = runs_as_ddp(stages), runs_as_fsdp(stages)  # plain tensors: DDP, or FSDP at a ZeRO level
    for stage in stages:
        work.update(stage_node_work(stage, graph, setup, ddp=ddp or fsdp))
    order = [stage_of[node.name] for node in graph.nodes]
    runs = chunks_of(order)
    chunks = tuple(_chunk(graph, run, order[run[0]], work) for run in runs)
    fsdp_step = fsdp_price(stages[0], graph, setup, work=work, num_microbatches=m) if fsdp else None
    if fsdp_step is not None:  # FSDP's gathers the compute waits for, on average per microbatch
        chunks = tuple(
            replace(c, fwd_s=c.fwd_s + fsdp_step.forward_wait_s, bwd_s=c.bwd_s + fsdp_step.backward_wait_s)
            for c in chunks
        )
    pipeline = schedule in PIPELINE_SCHEDULES and [c.stage for c in chunks] == list(range(len(stages)))
    if pipeline and len(stages) > 1:  # the schedule's host work per stage and microbatch, half per pass
        half = setup.cluster.device.microbatch_overhead_s / 2
        chunks = tuple(replace(c, fwd_s=c.fwd_s + half, bwd_s=c.bwd_s + half) for c in chunks)
    edges, grad_edges = pipeline_edges(graph, runs, setup) if pipeline else dataflow_edges(graph, runs, setup)
    # tied weights' gradients are summed over every rank after the backward pass (executors.parallel.stages.sync_shared_grads)
    tied_s = shared_param_sync_s(stages, graph, setup) if pipeline and len(stages) > 1 else 0.0
    step_s = [
        math.fsum(work[n].step_s for n in stage.nodes) + setup.cluster.device.step_overhead_s + tied_s
        for stage in stages
    ]
    state_bytes = [math.fsum(work[n].state_bytes for n in stage.nodes) for stage in stages]
    step_bytes: tuple[float, ...] = ()
    if pipeline or ddp or fsdp:  # one chunk per stage: its memory as the estimate charges it (plan_memory)
        memories = [
            _stage_memory(
                stage, graph, setup, m=m, last=s == len(stages) - 1, fsdp=fsdp, ddp=ddp, pipeline=len(stages) > 1
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
    segments: dict[int, tuple[SyncSegment, ...]] = {}
    if fsdp_step is not None:  # the last reduce-scatters instead of the additive shares
        step_s[0] += fsdp_step.tail_s - math.fsum(work[n].zero_step_s for n in stages[0].nodes)
    for s, stage in enumerate(stages if (pipeline or ddp) and not fsdp else ()):  # buckets, not the additive shares
        sync = stage_sync(stage, graph, {n: work[n].bwd_s for n in stage.nodes}, setup, grad_sync=grad_sync, ddp=ddp)
        if sync.segments:
            step_s[s] += sync.amortised_s - math.fsum(work[n].grad_sync_s for n in stage.nodes)
            state_bytes[s] += sync.state_bytes
            segments[s] = sync.segments
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
        schedule=schedule if pipeline else "dataflow",
        num_microbatches=m,
        transfer_s=stage_transfer(setup, [stage.devices for stage in stages], pipeline=pipeline),
        totals_s={
            key: math.fsum(getattr(w, key) for w in work.values()) for key in ("compute_s", "comm_s", "reshard_s")
        }
        | {"step_s": math.fsum(work[n].step_s for n in stages[0].nodes)},
        sync_segments=segments,
    )


def _stage_memory(
    stage: Stage, graph: OpGraph, setup: CostSetup, *, m: int, last: bool, fsdp: bool, ddp: bool, pipeline: bool
) -> StageMemory:
    """A pipeline stage's (or a data-parallel plan's) memory parts, as the estimate charges them: FSDP's through
    :func:`planner.costing.zero.fsdp_memory`, any other stage's through
    :func:`planner.costing.plan_memory.sharded_stage_memory`."""
    if fsdp:
        return fsdp_memory(stage, graph, setup, num_microbatches=m)
    data = frozenset(value.name for value in graph.inputs)
    return sharded_stage_memory(
        stage, graph, setup, in_flight=1, num_microbatches=m, last=last, data_inputs=data, ddp=ddp, pipeline=pipeline
    )


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
