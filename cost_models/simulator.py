"""Discrete-event simulation of a task graph on devices and links: the one judge of every plan.

A :class:`TaskGraph` holds *resources* and *tasks*. A resource is a group of devices that work
together (a pipeline stage's SPMD mesh, or one device of a placement) or a link between two of
them. A task occupies one resource for ``duration_s`` seconds, may start only when every task it
depends on has finished, and on a device resource may allocate memory when it starts
(``alloc_bytes``) and release memory when it ends (``free_bytes``).

Each resource runs one task at a time, in one of two orders:

* ``"fixed"``: exactly the order given by :meth:`TaskGraph.set_order` (a pipeline schedule such
  as GPipe or 1F1B); the next task waits for its inputs even if a later one is ready;
* ``"ready"``: whichever of its ready tasks has the smallest ``(priority, ready time, id)``
  (list scheduling: the dataflow order of an op placement).

:func:`simulate` is an event loop over task completions (a heap keyed by finish time). A task's
start is ``max(resource free, last dependency finished)``; the step time is the makespan. It
reports, per device, the busy seconds (sum of its resources' task durations), the idle seconds
(makespan − busy), the peak memory (``base_memory_bytes`` + the running sum of allocations minus
releases, at its highest) and the pipeline bubble (:func:`bubble_fraction`, the one definition the
estimate uses too): the resources with devices are the stages, each stage's busy time is its tasks
but those marked ``end_of_step`` (gradient sync, optimizer update), and the span is the end of the
last task not so marked. With ``record=True`` it also keeps every task's start and end
(:class:`Span`), for timelines.

A ``background`` task runs on its resource like any other but belongs to the steps that follow (the
communication Delayed Gradient Averaging hides behind them): the step time is the end of the last task that is
not background, and :attr:`SimResult.background_s` sums the background tasks' seconds.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

ORDERS = ("fixed", "ready")


def bubble_fraction(stage_busy_s: Sequence[float], *, pipeline_span_s: float) -> float:
    """The pipeline bubble: the share of the pipeline phase that the stages sit idle, averaged over stages.

    This is the one bubble autoplan reports (``plan``, ``plan show``, ``plan compare``; the estimate of
    :mod:`planner.inter.pricing` and this simulator compute it the same way). The pipeline phase runs
    from the first forward to the last backward of a step; the gradient sync, optimizer update and
    per-step overhead after it are not part of it. A stage is a group of devices working together (a
    pipeline stage's mesh, or one device of an operator placement); ``stage_busy_s`` is each one's
    forward and backward seconds in that phase (stages without work are left out), so the bubble is
    ``1 − Σ busy / (S · span)``: 0 for one stage, ``(S − 1) / (m + S − 1)`` for S equal stages and m
    microbatches.
    """
    working = [busy for busy in stage_busy_s if busy > 0]
    if not working or pipeline_span_s <= 0:
        return 0.0
    return max(0.0, 1.0 - math.fsum(working) / (len(working) * pipeline_span_s))  # no -0% from rounding


@dataclass(frozen=True, kw_only=True, slots=True)
class Span:
    task: str
    resource: str
    start_s: float
    end_s: float


@dataclass(frozen=True, kw_only=True)
class SimResult:
    step_time_s: float
    busy_s: tuple[float, ...]  # per device of the cluster
    idle_s: tuple[float, ...]
    peak_memory_bytes: tuple[float, ...]
    bubble_fraction: float
    spans: tuple[Span, ...] = ()
    background_s: float = 0.0  # the background tasks' seconds: run beside the step, off its critical path

    @property
    def max_memory_bytes(self) -> float:
        return max(self.peak_memory_bytes, default=0.0)


@dataclass(kw_only=True)
class _Resource:
    name: str
    devices: tuple[int, ...]
    order: str
    base_memory_bytes: float
    sequence: list[int] = field(default_factory=list)


class TaskGraph:
    """A builder: add resources, then tasks (dependencies before dependents), then simulate."""

    def __init__(self, *, num_devices: int) -> None:
        self.num_devices = num_devices
        self.resources: list[_Resource] = []
        self.names: list[str] = []
        self.resource_of: list[int] = []
        self.duration_s: list[float] = []
        self.deps: list[tuple[int, ...]] = []
        self.alloc_bytes: list[float] = []
        self.free_bytes: list[float] = []
        self.priority: list[float] = []
        self.end_of_step: list[bool] = []
        self.background: list[bool] = []

    def __len__(self) -> int:
        return len(self.names)

    def add_resource(
        self, name: str, *, devices: Sequence[int] = (), order: str = "ready", base_memory_bytes: float = 0.0
    ) -> int:
        assert order in ORDERS, f"order {order!r} is not one of {ORDERS}"
        assert all(0 <= d < self.num_devices for d in devices), f"resource {name} names a device outside the cluster"
        self.resources.append(
            _Resource(name=name, devices=tuple(devices), order=order, base_memory_bytes=base_memory_bytes)
        )
        return len(self.resources) - 1

    def add_task(
        self,
        name: str,
        *,
        resource: int,
        duration_s: float,
        deps: Sequence[int] = (),
        alloc_bytes: float = 0.0,
        free_bytes: float = 0.0,
        priority: float = 0.0,
        end_of_step: bool = False,
        background: bool = False,
    ) -> int:
        """``end_of_step``: work after the pipeline phase (gradient sync, optimizer update), outside the bubble;
        ``background``: work the following steps overlap, outside the step time (module docstring)."""
        task = len(self.names)
        assert 0 <= resource < len(self.resources), f"task {name}: unknown resource {resource}"
        assert duration_s >= 0 and math.isfinite(duration_s), f"task {name}: duration {duration_s}"
        assert all(0 <= d < task for d in deps), f"task {name}: dependencies must be added first"
        self.names.append(name)
        self.resource_of.append(resource)
        self.duration_s.append(float(duration_s))
        self.deps.append(tuple(deps))
        self.alloc_bytes.append(float(alloc_bytes))
        self.free_bytes.append(float(free_bytes))
        self.priority.append(float(priority))
        self.end_of_step.append(end_of_step or background)
        self.background.append(background)
        return task

    def set_order(self, resource: int, tasks: Sequence[int]) -> None:
        """The exact order of a ``"fixed"`` resource: every task on it, once."""
        assert self.resources[resource].order == "fixed", f"resource {self.resources[resource].name} is not fixed"
        self.resources[resource].sequence = list(tasks)


def _check_orders(graph: TaskGraph) -> None:
    on: dict[int, list[int]] = {}
    for task, resource in enumerate(graph.resource_of):
        on.setdefault(resource, []).append(task)
    for index, resource in enumerate(graph.resources):
        if resource.order == "fixed":
            assert sorted(resource.sequence) == on.get(index, []), (
                f"fixed order of {resource.name} must list each of its tasks once"
            )


@dataclass(kw_only=True)
class _State:
    free: list[bool]
    ready: list[list[tuple[float, float, int]]]  # per ready-order resource: heap of (priority, ready at, task)
    is_ready: list[bool]
    ready_at: list[float]
    cursor: list[int]  # per fixed resource: next position in its sequence
    start: list[float]


def simulate(graph: TaskGraph, *, record: bool = False) -> SimResult:
    """Run the task graph; every task must be able to run (no cycle, fixed orders consistent)."""
    _check_orders(graph)
    n, resources = len(graph), graph.resources
    dependents: list[list[int]] = [[] for _ in range(n)]
    waiting = [len(set(d)) for d in graph.deps]
    for task, deps in enumerate(graph.deps):
        for dep in set(deps):
            dependents[dep].append(task)
    state = _State(
        free=[True] * len(resources),
        ready=[[] for _ in resources],
        is_ready=[False] * n,
        ready_at=[0.0] * n,
        cursor=[0] * len(resources),
        start=[math.nan] * n,
    )
    events: list[tuple[float, int]] = []
    memory = [r.base_memory_bytes for r in resources]
    peak = list(memory)
    for task in range(n):
        if waiting[task] == 0:
            _make_ready(graph, state, task, 0.0)
    for resource in range(len(resources)):
        _try_start(graph, state, resource, 0.0, events, memory, peak)
    finished, now, step_end = 0, 0.0, 0.0
    while events:
        now, task = heapq.heappop(events)
        finished += 1
        step_end = step_end if graph.background[task] else now
        resource = graph.resource_of[task]
        state.free[resource] = True
        memory[resource] -= graph.free_bytes[task]
        touched = {resource}
        for successor in dependents[task]:
            waiting[successor] -= 1
            if waiting[successor] == 0:
                _make_ready(graph, state, successor, now)
                touched.add(graph.resource_of[successor])
        for r in touched:
            _try_start(graph, state, r, now, events, memory, peak)
    assert finished == n, f"simulation stalled: {n - finished} of {n} tasks never ran (a cycle or an order clash)"
    return _result(graph, state, makespan=step_end, peak=peak, record=record)


def _make_ready(graph: TaskGraph, state: _State, task: int, now: float) -> None:
    state.is_ready[task] = True
    state.ready_at[task] = now
    resource = graph.resource_of[task]
    if graph.resources[resource].order == "ready":
        heapq.heappush(state.ready[resource], (graph.priority[task], now, task))


def _try_start(
    graph: TaskGraph, state: _State, resource: int, now: float, events: list, memory: list[float], peak: list[float]
) -> None:
    if not state.free[resource]:
        return
    spec = graph.resources[resource]
    if spec.order == "fixed":
        if state.cursor[resource] >= len(spec.sequence):
            return
        task = spec.sequence[state.cursor[resource]]
        if not state.is_ready[task]:
            return
        state.cursor[resource] += 1
    else:
        if not state.ready[resource]:
            return
        task = heapq.heappop(state.ready[resource])[2]
    state.free[resource] = False
    state.start[task] = now
    memory[resource] += graph.alloc_bytes[task]
    peak[resource] = max(peak[resource], memory[resource])
    heapq.heappush(events, (now + graph.duration_s[task], task))


def _pipeline_bubble(graph: TaskGraph, state: _State) -> float:
    """:func:`bubble_fraction` of the simulated step: stages are the resources with devices."""
    busy, span = [0.0] * len(graph.resources), 0.0
    for task, resource in enumerate(graph.resource_of):
        if not graph.end_of_step[task]:
            busy[resource] += graph.duration_s[task]
            span = max(span, state.start[task] + graph.duration_s[task])
    stages = [busy[index] for index, resource in enumerate(graph.resources) if resource.devices]
    return bubble_fraction(stages, pipeline_span_s=span)


def _result(graph: TaskGraph, state: _State, *, makespan: float, peak: list[float], record: bool) -> SimResult:
    busy = [0.0] * graph.num_devices
    device_peak = [0.0] * graph.num_devices
    per_resource = [0.0] * len(graph.resources)
    for task, resource in enumerate(graph.resource_of):
        per_resource[resource] += graph.duration_s[task]
    for index, resource in enumerate(graph.resources):
        for device in resource.devices:
            busy[device] += per_resource[index]
            device_peak[device] = max(device_peak[device], peak[index])
    spans = ()
    if record:
        spans = tuple(
            Span(
                task=graph.names[t],
                resource=graph.resources[graph.resource_of[t]].name,
                start_s=state.start[t],
                end_s=state.start[t] + graph.duration_s[t],
            )
            for t in range(len(graph))
        )
    return SimResult(
        step_time_s=makespan,
        busy_s=tuple(busy),
        idle_s=tuple(makespan - b for b in busy),
        peak_memory_bytes=tuple(device_peak),
        bubble_fraction=_pipeline_bubble(graph, state),
        spans=spans,
        background_s=math.fsum(graph.duration_s[t] for t in range(len(graph)) if graph.background[t]),
    )
