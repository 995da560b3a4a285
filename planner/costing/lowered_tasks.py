"""A lowered plan as the simulator's task graph (:mod:`cost_models.simulator`): the pieces and how they run.

:class:`Lowered` is what :mod:`planner.costing.lowering` makes of a plan (or an op placement,
:mod:`planner.baselines.placement.dataflow`): its chunks (runs of one stage's nodes, :class:`Chunk`), the bytes
crossing between them, each stage's devices, state and step. :func:`build_tasks` turns it into tasks: per microbatch
a forward ``F`` and a backward ``B`` per chunk on its pipeline rank's resource (zero bubble: ``I`` then ``W``), a
transfer on a link resource per ordered pair of ranks for each crossing value and its gradient, a stage's last
backward cut where its gradient buckets become ready with their all-reduces on a communication resource (and the
part of them later steps hide, DGA's, as background tasks off the step: :func:`hidden_syncs`), and one
``step`` task per stage; pipeline ranks run their tasks in the schedule's order
(:func:`planner.plan.schedules.rank_actions`), the others whichever became ready first. The module docstring of
:mod:`planner.costing.lowering` says what each task costs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from cost_models.simulator import TaskGraph
from planner.costing.overlap import SyncSegment
from planner.plan.schedules import Schedule, rank_actions

PIPELINE_SCHEDULES = (Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED, Schedule.ZERO_BUBBLE, Schedule.NONE)


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
    tasks = _TaskBuilder(lowered, include_transfers=include_transfers, include_step=include_step)
    tasks.add_forwards()
    tasks.add_backwards()
    tasks.add_steps()
    if lowered.schedule in PIPELINE_SCHEDULES:
        weights = {("W", c, i): task for (c, i), task in tasks.weight.items()}
        _set_pipeline_orders(
            tasks.graph, lowered, tasks.groups, tasks.forward, tasks.backward | weights, tasks.steps, tasks.parts
        )
    return tasks.graph


class _TaskBuilder:
    """The task graph of one lowered plan as it is built: one resource per pipeline rank (its stages share its
    devices and memory), a link per ordered pair of ranks, and the tasks by (chunk, microbatch)."""

    def __init__(self, lowered: Lowered, *, include_transfers: bool, include_step: bool) -> None:
        self.lowered, self.include_transfers, self.include_step = lowered, include_transfers, include_step
        self.graph = TaskGraph(num_devices=lowered.num_devices)
        self.groups = self._rank_resources()
        self.stages = [self.groups[lowered.group_of(s)] for s in range(len(lowered.stage_devices))]
        self.links: dict[tuple[int, int], int] = {}
        self.forward: dict[tuple[int, int], int] = {}
        self.backward: dict[tuple[int, int], int] = {}  # B, or I under zero bubble
        self.weight: dict[tuple[int, int], int] = {}  # W under zero bubble
        self.parts: dict[tuple[int, int], list[int]] = {}  # a last backward cut at its buckets
        self.syncs: dict[int, list[int]] = {}  # per stage, its bucket all-reduces
        self.steps: dict[int, int] = {}
        # I (input gradients, what the stage before waits for), later W
        self.split = lowered.schedule == Schedule.ZERO_BUBBLE

    def _rank_resources(self) -> list[int]:
        lowered, fixed = self.lowered, self.lowered.schedule in PIPELINE_SCHEDULES
        num_groups = 1 + max(lowered.group_of(s) for s in range(len(lowered.stage_devices)))
        groups = []
        for g in range(num_groups):
            members = [s for s in range(len(lowered.stage_devices)) if lowered.group_of(s) == g]
            groups.append(
                self.graph.add_resource(
                    f"stage {g}" if len(members) == 1 else f"rank {g}",
                    devices=lowered.stage_devices[members[0]],
                    order="fixed" if fixed else "ready",
                    base_memory_bytes=math.fsum(lowered.state_bytes[s] for s in members),
                )
            )
        return groups

    def _link(self, a: int, b: int) -> int:
        a, b = self.lowered.group_of(a), self.lowered.group_of(b)
        if (a, b) not in self.links:
            self.links[a, b] = self.graph.add_resource(f"link {a}>{b}", order="ready")
        return self.links[a, b]

    def _arrival(self, name: str, a: int, b: int, num_bytes: float, after: int) -> int:
        """``after`` itself on one stage, else the transfer of ``num_bytes`` from stage ``a`` to ``b`` after it."""
        if a == b:
            return after
        seconds = self.lowered.transfer_s(a, b, num_bytes) if self.include_transfers else 0.0
        return self.graph.add_task(name, resource=self._link(a, b), duration_s=seconds, deps=(after,))

    def add_forwards(self) -> None:
        chunks = self.lowered.chunks
        into: list[list[tuple[int, float]]] = [[] for _ in chunks]
        for (u, v), num_bytes in sorted(self.lowered.edges.items()):
            into[v].append((u, num_bytes))
        for i in range(self.lowered.num_microbatches):
            for c, chunk in enumerate(chunks):
                deps = [
                    self._arrival(f"F{i} {u}>{c}", chunks[u].stage, chunk.stage, num_bytes, self.forward[u, i])
                    for u, num_bytes in into[c]
                ]
                self.forward[c, i] = self.graph.add_task(
                    f"F{i} c{c}",
                    resource=self.stages[chunk.stage],
                    duration_s=chunk.fwd_s,
                    deps=deps,
                    alloc_bytes=chunk.activation_bytes + chunk.transient_bytes,
                    free_bytes=chunk.transient_bytes,
                )

    def add_backwards(self) -> None:
        chunks, m = self.lowered.chunks, self.lowered.num_microbatches
        out: list[list[tuple[int, float]]] = [[] for _ in chunks]
        for u, v in sorted(self.lowered.edges):
            out[u].append((v, self.lowered.grad_edges.get((u, v), 0.0)))
        for i in range(m):
            for c in reversed(range(len(chunks))):
                chunk, deps = chunks[c], [self.forward[c, i]]
                for v, num_bytes in out[c]:
                    deps.append(
                        self._arrival(f"B{i} {v}>{c}", chunks[v].stage, chunk.stage, num_bytes, self.backward[v, i])
                    )
                segments = self.lowered.sync_segments.get(chunk.stage, ()) if i == m - 1 else ()
                self._add_backward(c, i, deps, segments)

    def _add_backward(self, c: int, i: int, deps: list[int], segments: Sequence[SyncSegment]) -> None:
        chunk, graph = self.lowered.chunks[c], self.graph
        resource = self.stages[chunk.stage]
        if segments and not self.split:  # the buckets go out while the stage's last backward runs
            self.parts[c, i], self.syncs[chunk.stage] = _overlapped_backward(
                graph, segments, resource, f"B{i} c{c}", chunk, deps, include_step=self.include_step
            )
            self.backward[c, i] = self.parts[c, i][-1]
        elif self.split:
            self.backward[c, i] = graph.add_task(
                f"I{i} c{c}",
                resource=resource,
                duration_s=chunk.bwd_s - chunk.weight_grad_s,
                deps=deps,
                alloc_bytes=chunk.transient_bytes + chunk.deferred_bytes,
                free_bytes=chunk.transient_bytes,
            )
            self.weight[c, i] = graph.add_task(
                f"W{i} c{c}",
                resource=resource,
                duration_s=chunk.weight_grad_s,
                deps=(self.backward[c, i],),
                free_bytes=chunk.activation_bytes + chunk.deferred_bytes,
            )
        else:
            self.backward[c, i] = graph.add_task(
                f"B{i} c{c}",
                resource=resource,
                duration_s=chunk.bwd_s,
                deps=deps,
                alloc_bytes=chunk.transient_bytes,
                free_bytes=chunk.activation_bytes + chunk.transient_bytes,
            )

    def add_steps(self) -> None:
        lowered, m = self.lowered, self.lowered.num_microbatches
        for s, resource in enumerate(self.stages):
            mine = [
                self.weight.get((c, i), self.backward[c, i])
                for c, chunk in enumerate(lowered.chunks)
                if chunk.stage == s
                for i in range(m)
            ]
            seconds = lowered.step_s[s] if self.include_step else 0.0
            if self.split and lowered.sync_segments.get(s):  # zero bubble: the buckets go out after the last W
                self.syncs[s] = _syncs_after(
                    self.graph, lowered.sync_segments[s], after=mine[-1], include_step=self.include_step
                )
            at_end = lowered.step_bytes[s] if lowered.step_bytes else 0.0  # what the last backward leaves, the buckets
            self.steps[s] = self.graph.add_task(
                f"step s{s}",
                resource=resource,
                duration_s=seconds,
                deps=mine + self.syncs.get(s, []),
                end_of_step=True,
                alloc_bytes=at_end,
                free_bytes=at_end,
            )


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
    if include_step:
        hidden_syncs(graph, segments, parts, name)
    return parts, syncs


HIDDEN_SYNC = "hidden behind the next steps"  # the name's tail of a bucket's hidden communication (DGA)


def hidden_syncs(graph: TaskGraph, segments: Sequence[SyncSegment], parts: Sequence[int], name: str) -> None:
    """The communication of each bucket that later steps hide (``SyncSegment.hidden_s``, DGA), as background tasks
    from the bucket's ready time on their own link resource, one after another: on the timeline, off the step."""
    if not any(segment.hidden_s > 0 for segment in segments):
        return
    link = graph.add_resource(f"{name} sync, {HIDDEN_SYNC}", order="ready")
    previous: tuple[int, ...] = ()
    for k, (segment, part) in enumerate(zip(segments, parts, strict=True)):
        if segment.hidden_s > 0:
            task = graph.add_task(
                f"sync bucket {k}, {HIDDEN_SYNC}",
                resource=link,
                duration_s=segment.hidden_s,
                deps=(part, *previous),
                background=True,
            )
            previous = (task,)


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
    """Each pipeline rank runs its stages' tasks in the schedule's order
    (:func:`planner.plan.schedules.rank_actions`), then its stages' steps. ``backward`` holds ``B``/``I`` tasks by
    ``(stage, i)``, ``W`` tasks by ``("W", stage, i)``."""
    count = len(lowered.chunks)
    assert [chunk.stage for chunk in lowered.chunks] == list(range(count)), "a pipeline has one chunk per stage"
    schedule = Schedule.ONE_F_ONE_B if lowered.schedule == Schedule.NONE else lowered.schedule
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
