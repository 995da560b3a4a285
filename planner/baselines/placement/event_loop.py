"""The simulator's event loop over a placement's task arrays, compiled
(:mod:`planner.baselines.placement.batched_simulator`).

:func:`run_tasks` is :func:`cost_models.simulator.simulate` on arrays: each device and each ordered pair of devices
(a link) runs one task at a time; a finished task (events in ``(finish time, task)`` order, a binary heap,
:func:`_push_event` and :func:`_pop_event`) frees its resource and readies the tasks waiting only on it
(:func:`_release`); a free resource starts its ready task with the smallest ``(ready time, task)``. Ready times only
grow, so each resource's ready tasks are a queue kept in that order by inserting a new one behind those readied
earlier or with smaller numbers. Memory rises when a task starts (its peak) and falls when it ends. The step time is
the last finish.

The helpers are inlined into the loop by numba (``inline="always"``): a call that passes arrays costs reference
counting, which in this loop was most of the time, so the compiled loop is still one function.
"""

from __future__ import annotations

import numba
import numpy as np

_JIT = {"cache": True, "nogil": True}


@numba.njit(**_JIT)
def run_tasks(resource, duration, alloc, free, dep_start, deps, base, out_peak):
    """The makespan of the tasks (resource, seconds, bytes allocated at start and freed at the end, dependencies
    in CSR from ``dep_start``), the devices' memory starting at ``base``; the peak per device into ``out_peak``."""
    n, num_devices = resource.shape[0], base.shape[0]
    num_resources = num_devices + num_devices * num_devices
    waiting, after_start, after = _dependents(dep_start, deps, n)
    head, tail = _queue_heads(resource, num_resources)  # per resource, its ready tasks: [head, tail) of its segment
    queued, ready_at = np.empty(n, dtype=np.int64), np.empty(n)
    busy = np.zeros(num_resources, dtype=np.bool_)
    memory = np.zeros(num_resources)
    memory[:num_devices] = base
    peak = memory.copy()
    event_time, event_task = np.empty(num_resources + 1), np.empty(num_resources + 1, dtype=np.int64)
    touched = np.empty(num_resources + n, dtype=np.int64)  # resources that may start a task now
    events, now, task = 0, 0.0, -1
    while True:
        if task < 0:  # the start: every task without dependencies is ready, every resource may start
            count = _ready_at_start(waiting, resource, queued, ready_at, tail, touched, num_resources)
        else:
            count = _release(
                task,
                now,
                resource,
                free,
                busy,
                memory,
                touched,
                after_start,
                after,
                waiting,
                queued,
                ready_at,
                head,
                tail,
            )
        for c in range(count):  # an idle resource starts its first ready task
            r = touched[c]
            if busy[r] or head[r] == tail[r]:
                continue
            started = queued[head[r]]
            head[r] += 1
            busy[r] = True
            memory[r] += alloc[started]
            peak[r] = max(peak[r], memory[r])
            events = _push_event(event_time, event_task, events, now + duration[started], started)
        if events == 0:
            break
        now, task, events = _pop_event(event_time, event_task, events)
    for d in range(num_devices):
        out_peak[d] = max(0.0, peak[d])
    return now


@numba.njit(inline="always", **_JIT)
def _queue_heads(resource, num_resources):
    """Where each resource's queue starts: one segment per resource, as long as its number of tasks."""
    queue_start = np.zeros(num_resources + 1, dtype=np.int64)
    for t in range(resource.shape[0]):
        queue_start[resource[t] + 1] += 1
    for r in range(num_resources):
        queue_start[r + 1] += queue_start[r]
    return queue_start[:num_resources].copy(), queue_start[:num_resources].copy()


@numba.njit(inline="always", **_JIT)
def _ready_at_start(waiting, resource, queued, ready_at, tail, touched, num_resources):
    """Queue every task without dependencies at time 0; every resource may start one (their count)."""
    for t in range(waiting.shape[0]):
        if waiting[t] == 0:
            r = resource[t]
            queued[tail[r]], ready_at[tail[r]] = t, 0.0
            tail[r] += 1
    for r in range(num_resources):
        touched[r] = r
    return num_resources


@numba.njit(inline="always", **_JIT)
def _release(
    task, now, resource, free, busy, memory, touched, after_start, after, waiting, queued, ready_at, head, tail
):
    """``task`` finished at ``now``: its resource is free, its bytes freed, the tasks waiting only on it queued;
    the resources that may start a task now into ``touched`` (their count)."""
    r = resource[task]
    busy[r] = False
    memory[r] -= free[task]
    touched[0] = r
    count = 1
    for k in range(after_start[task], after_start[task + 1]):
        s = after[k]
        waiting[s] -= 1
        if waiting[s] == 0:  # ready now: behind those readied earlier or numbered lower
            r = resource[s]
            q = tail[r]
            while q > head[r] and ready_at[q - 1] == now and queued[q - 1] > s:
                queued[q], ready_at[q] = queued[q - 1], ready_at[q - 1]
                q -= 1
            queued[q], ready_at[q] = s, now
            tail[r] += 1
            touched[count] = r
            count += 1
    return count


@numba.njit(inline="always", **_JIT)
def _push_event(event_time, event_task, events, finish, started):
    """Push ``(finish, started)`` on the binary min-heap of the first ``events`` events; the new count."""
    k = events
    while k > 0:
        parent = (k - 1) >> 1
        if event_time[parent] < finish or (event_time[parent] == finish and event_task[parent] < started):
            break
        event_time[k], event_task[k] = event_time[parent], event_task[parent]
        k = parent
    event_time[k], event_task[k] = finish, started
    return events + 1


@numba.njit(inline="always", **_JIT)
def _pop_event(event_time, event_task, events):
    """Pop the first event: (its time, its task, the events left)."""
    now, task = event_time[0], event_task[0]
    events -= 1
    last_time, last_task = event_time[events], event_task[events]
    k = 0
    while True:
        child = 2 * k + 1
        if child >= events:
            break
        if child + 1 < events and (
            event_time[child + 1] < event_time[child]
            or (event_time[child + 1] == event_time[child] and event_task[child + 1] < event_task[child])
        ):
            child += 1
        if last_time < event_time[child] or (last_time == event_time[child] and last_task < event_task[child]):
            break
        event_time[k], event_task[k] = event_time[child], event_task[child]
        k = child
    event_time[k], event_task[k] = last_time, last_task
    return now, task, events


@numba.njit(**_JIT)
def _dependents(dep_start, deps, n):
    """Per task the number of its dependencies, and the tasks that wait for it (CSR)."""
    waiting = np.zeros(n, dtype=np.int64)
    after_start = np.zeros(n + 1, dtype=np.int64)
    for t in range(n):
        waiting[t] = dep_start[t + 1] - dep_start[t]
        for k in range(dep_start[t], dep_start[t + 1]):
            after_start[deps[k] + 1] += 1
    for t in range(n):
        after_start[t + 1] += after_start[t]
    after = np.empty(after_start[n], dtype=np.int64)
    filled = after_start[:n].copy()
    for t in range(n):
        for k in range(dep_start[t], dep_start[t + 1]):
            after[filled[deps[k]]] = t
            filled[deps[k]] += 1
    return waiting, after_start, after
