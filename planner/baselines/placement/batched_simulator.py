"""Many placements of one placement problem simulated at once, in compiled code, exactly as the simulator does.

:func:`simulate_placements` gives, for each row of a ``(B, N)`` array of devices per op, the step
time and the per-device peak memory that :func:`planner.baselines.placement.dataflow.simulate_assignment`
(the lowering of :mod:`planner.costing.lowering` and the event loop of :mod:`cost_models.simulator`)
gives for it, bit for bit. It does the same work without Python objects, compiled by numba
(:func:`_simulate_one`, one placement; :func:`_simulate_batch`, a batch spread over the cores):

1. **Chunks** (:func:`_chunks`): the maximal runs of consecutive ops on one device. A chunk's forward and
   backward seconds are ``fsum`` of its ops' over the device's speed, its activations ``fsum`` of its
   ops' (:func:`~planner.baselines.placement.exact_sum.fsum_prefix`, ``math.fsum`` compiled, so every sum is
   the simulator's).
   A device's model state is ``fsum`` of its ops' state bytes; its step ``fsum`` of its ops' updates over
   its speed, plus ``step_overhead_s``.
2. **Chunk edges** (:func:`_chunk_edges`): the op edges that cross chunks, their bytes added in the
   problem's edge order per ``(chunk from, chunk to)`` pair, sorted by pair.
3. **Tasks** (:func:`_build_tasks`), numbered as :func:`planner.costing.lowered_tasks.build_tasks` numbers
   them, since the event loop breaks ties by number: per microbatch ``i`` and chunk ``c`` in order, a
   transfer per crossing edge into ``c`` from another device (on the link ``(a, b)``, seconds
   :meth:`PlacementProblem.transfer_s`), then ``F(c, i)`` (allocates the chunk's activations); per
   microbatch and chunk in reverse, a transfer per edge out of ``c`` to another device (its gradient
   coming back), then ``B(c, i)`` (frees them); then one step per device after its backwards.
4. **Event loop** (:func:`planner.baselines.placement.event_loop.run_tasks`): each device and each ordered pair
   of devices (a link) runs one task at a time; a finished task (events in ``(finish time, task)`` order, a
   binary heap) frees its resource and readies the tasks waiting only on it; a free resource starts its ready task with
   the smallest ``(ready time, task)``. Ready times only grow, so each resource's ready tasks are a queue kept in
   that order by inserting a new one behind those readied earlier or with smaller numbers. Memory rises
   when a task starts (its peak) and falls when it ends. The step time is the last finish.

A test (``tests/test_batched_simulator.py``) checks random placements of random problems and of GPT
against :func:`~planner.baselines.placement.dataflow.simulate_assignment` for equality. The first call in a
process compiles the kernels (about 10 s; cached on disk by numba afterwards).
"""

from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numba
import numpy as np

from planner.baselines.placement.event_loop import run_tasks
from planner.baselines.placement.exact_sum import fsum_prefix
from planner.baselines.placement.problem import PlacementProblem

MAX_THREADS = 8
MIN_ROWS_PER_THREAD = 8


@dataclass(frozen=True, kw_only=True)
class BatchResult:
    step_time_s: np.ndarray  # (B,)
    peak_memory_bytes: np.ndarray  # (B, D)


def simulate_placements(problem: PlacementProblem, placements: np.ndarray) -> BatchResult:
    """Step time and peak memory per device of every row of ``placements`` (``(B, N)``, a device per op)."""
    rows = np.ascontiguousarray(placements, dtype=np.int64)
    assert rows.ndim == 2 and rows.shape[1] == problem.num_ops, f"placements {rows.shape} for {problem.num_ops} ops"
    assert rows.size == 0 or (rows.min() >= 0 and rows.max() < problem.num_devices), "a device outside the problem"
    arrays = problem_arrays(problem)
    step = np.empty(rows.shape[0])
    peak = np.empty((rows.shape[0], problem.num_devices))
    _simulate_batch(rows, arrays, step, peak)
    return BatchResult(step_time_s=step, peak_memory_bytes=peak)


def problem_arrays(problem: PlacementProblem) -> tuple:
    """The problem as the kernels' arguments (after the placements, before the outputs)."""
    edges = np.array([(u, v) for u, v, _ in problem.edges], dtype=np.int64).reshape(-1, 2)
    return (
        np.array(problem.fwd_s, dtype=np.float64),
        np.array(problem.bwd_s, dtype=np.float64),
        np.array(problem.step_s, dtype=np.float64),
        np.array(problem.state_bytes, dtype=np.float64),
        np.array(problem.activation_bytes, dtype=np.float64),
        np.ascontiguousarray(edges[:, 0]),
        np.ascontiguousarray(edges[:, 1]),
        np.array([b for _, _, b in problem.edges], dtype=np.float64),
        np.array(problem.device_speed, dtype=np.float64),
        np.array(problem.link_latency_s, dtype=np.float64),
        np.array(problem.link_bandwidth, dtype=np.float64),
        float(problem.step_overhead_s),
        int(problem.num_microbatches),
    )


def _simulate_batch(rows: np.ndarray, arrays: tuple, step: np.ndarray, peak: np.ndarray) -> None:
    """:func:`_simulate_rows` over the rows in slices, one per core (the kernels release the GIL)."""
    workers = min(os.cpu_count() or 1, MAX_THREADS, max(1, rows.shape[0] // MIN_ROWS_PER_THREAD))
    if workers == 1:
        _simulate_rows(rows, arrays, step, peak)
        return
    bounds = np.linspace(0, rows.shape[0], workers + 1).astype(int)
    with ThreadPoolExecutor(workers) as pool:
        done = [
            pool.submit(_simulate_rows, rows[a:b], arrays, step[a:b], peak[a:b]) for a, b in itertools.pairwise(bounds)
        ]
        for future in done:
            future.result()


_JIT = {"cache": True, "nogil": True}


@numba.njit(**_JIT)
def _simulate_rows(rows, arrays, out_step, out_peak):
    """:func:`_simulate_one` for each row; ``arrays`` is :func:`problem_arrays`' tuple."""
    for b in range(rows.shape[0]):
        out_step[b] = _simulate_one(rows[b], *arrays, out_peak[b])


@numba.njit(**_JIT)
def _chunks(row, fwd, bwd, act, speed):
    """Chunk of each op, each chunk's device, forward and backward seconds and activation bytes."""
    n = row.shape[0]
    chunk_of = np.empty(n, dtype=np.int64)
    count = 0
    for op in range(n):
        if op == 0 or row[op] != row[op - 1]:
            count += 1
        chunk_of[op] = count - 1
    device = np.empty(count, dtype=np.int64)
    f, b, a = np.empty(count), np.empty(count), np.empty(count)
    buf_f, buf_b, buf_a, partials = np.empty(n), np.empty(n), np.empty(n), np.empty(n + 1)
    start = 0
    for c in range(count):
        end = start
        while end < n and chunk_of[end] == c:
            buf_f[end - start], buf_b[end - start], buf_a[end - start] = fwd[end], bwd[end], act[end]
            end += 1
        device[c] = row[start]
        f[c] = fsum_prefix(buf_f, end - start, partials) / speed[row[start]]
        b[c] = fsum_prefix(buf_b, end - start, partials) / speed[row[start]]
        a[c] = fsum_prefix(buf_a, end - start, partials)
        start = end
    return chunk_of, device, f, b, a


@numba.njit(**_JIT)
def _device_sums(row, step, state, speed, overhead):
    """Per device: its model state (``fsum``) and its step (``fsum`` over its speed, plus the overhead)."""
    num_devices, n = speed.shape[0], row.shape[0]
    base, step_s = np.empty(num_devices), np.empty(num_devices)
    buf_step, buf_state, partials = np.empty(n), np.empty(n), np.empty(n + 1)
    for d in range(num_devices):
        count = 0
        for op in range(n):
            if row[op] == d:
                buf_step[count], buf_state[count] = step[op], state[op]
                count += 1
        base[d] = fsum_prefix(buf_state, count, partials)
        step_s[d] = fsum_prefix(buf_step, count, partials) / speed[d] + overhead
    return base, step_s


@numba.njit(**_JIT)
def _chunk_edges(chunk_of, num_chunks, edge_u, edge_v, edge_bytes):
    """``(from, to, bytes)`` of the chunk pairs with crossing edges, sorted; bytes added in edge order."""
    keys = np.empty(edge_u.shape[0], dtype=np.int64)
    count = 0
    for e in range(edge_u.shape[0]):
        cu, cv = chunk_of[edge_u[e]], chunk_of[edge_v[e]]
        if cu != cv:
            keys[count] = cu * num_chunks + cv
            count += 1
    order = np.argsort(keys[:count], kind="mergesort")  # stable: equal pairs keep the edge order
    crossing = np.empty(count, dtype=np.int64)
    k = 0
    for e in range(edge_u.shape[0]):
        if chunk_of[edge_u[e]] != chunk_of[edge_v[e]]:
            crossing[k] = e
            k += 1
    src, dst, total = np.empty(count, dtype=np.int64), np.empty(count, dtype=np.int64), np.empty(count)
    pairs = -1
    for k in range(count):
        e = crossing[order[k]]
        key = keys[order[k]]
        if pairs < 0 or key != src[pairs] * num_chunks + dst[pairs]:
            pairs += 1
            src[pairs], dst[pairs], total[pairs] = key // num_chunks, key % num_chunks, 0.0
        total[pairs] = total[pairs] + edge_bytes[e]
    return src[: pairs + 1], dst[: pairs + 1], total[: pairs + 1]


@numba.njit(**_JIT)
def _simulate_one(
    row, fwd, bwd, step, state, act, edge_u, edge_v, edge_bytes, speed, latency, bandwidth, overhead, m, out_peak
):
    """The step time of one placement; its peak memory per device into ``out_peak``."""
    chunk_of, device, f, b, a = _chunks(row, fwd, bwd, act, speed)
    base, step_s = _device_sums(row, step, state, speed, overhead)
    src, dst, num_bytes = _chunk_edges(chunk_of, device.shape[0], edge_u, edge_v, edge_bytes)
    resource, duration, alloc, free, dep_start, deps = _build_tasks(
        device, f, b, a, step_s, src, dst, num_bytes, latency, bandwidth, m
    )
    return run_tasks(resource, duration, alloc, free, dep_start, deps, base, out_peak)


@numba.njit(**_JIT)
def _build_tasks(device, f, b, a, step_s, src, dst, num_bytes, latency, bandwidth, m):
    """The dataflow task graph, numbered as ``build_tasks`` numbers it: resource (device ``d``, or link
    ``D + a·D + b``), seconds, bytes allocated at start and freed at the end, dependencies (CSR, ``deps``
    from ``dep_start[t]`` to ``dep_start[t + 1]``). A transfer is numbered before the task that waits for
    it, so that task's dependencies are gathered in ``waits`` first and stored after it."""
    num_chunks, num_pairs, num_devices = device.shape[0], src.shape[0], step_s.shape[0]
    into, into_start, out_start = _pair_offsets(src, dst, num_chunks)
    size = m * (2 * num_chunks + 2 * num_pairs) + num_devices
    resource, duration = np.empty(size, dtype=np.int64), np.empty(size)
    alloc, free = np.zeros(size), np.zeros(size)
    dep_start = np.zeros(size + 1, dtype=np.int64)
    deps = np.empty(m * (4 * num_pairs + 2 * num_chunks) + 1, dtype=np.int64)
    waits = np.empty(num_pairs + 1, dtype=np.int64)
    forward, backward = np.empty((num_chunks, m), dtype=np.int64), np.empty((num_chunks, m), dtype=np.int64)
    t, k = 0, 0  # tasks and dependencies so far
    for phase in range(2):  # forwards, then backwards with the chunks in reverse
        for i in range(m):
            for step in range(num_chunks):
                c = step if phase == 0 else num_chunks - 1 - step
                count = 0
                if phase == 1:
                    waits[0] = forward[c, i]
                    count = 1
                first, last = (into_start[c], into_start[c + 1]) if phase == 0 else (out_start[c], out_start[c + 1])
                for q in range(first, last):
                    p = into[q] if phase == 0 else q
                    other = src[p] if phase == 0 else dst[p]  # the producer, or the consumer sending a gradient
                    before = forward[other, i] if phase == 0 else backward[other, i]
                    if device[other] == device[c]:
                        waits[count] = before
                    else:  # a transfer from the other chunk's device, waiting for its task
                        seconds = _transfer_s(latency, bandwidth, device[other], device[c], num_bytes[p])
                        resource[t], duration[t] = num_devices + device[other] * num_devices + device[c], seconds
                        alloc[t], free[t], deps[k], dep_start[t + 1] = 0.0, 0.0, before, k + 1
                        waits[count], t, k = t, t + 1, k + 1
                    count += 1
                resource[t], duration[t] = device[c], f[c] if phase == 0 else b[c]
                alloc[t], free[t] = (a[c], 0.0) if phase == 0 else (0.0, a[c])
                deps[k : k + count] = waits[:count]
                k += count
                dep_start[t + 1] = k
                if phase == 0:
                    forward[c, i] = t
                else:
                    backward[c, i] = t
                t += 1
    t = _add_steps(device, step_s, backward, resource, duration, dep_start, deps, t, k, m)
    return resource[:t], duration[:t], alloc[:t], free[:t], dep_start[: t + 1], deps


@numba.njit(inline="always", **_JIT)
def _pair_offsets(src, dst, num_chunks):
    """The chunk pairs by (to, from), and the CSR offsets of the pairs into and out of each chunk."""
    into = np.argsort(dst, kind="mergesort")  # pairs by (to, from): the edges into each chunk, sources ascending
    into_start, out_start = np.zeros(num_chunks + 1, dtype=np.int64), np.zeros(num_chunks + 1, dtype=np.int64)
    for p in range(src.shape[0]):
        into_start[dst[p] + 1] += 1
        out_start[src[p] + 1] += 1
    for c in range(num_chunks):
        into_start[c + 1] += into_start[c]
        out_start[c + 1] += out_start[c]
    return into, into_start, out_start


@numba.njit(inline="always", **_JIT)
def _transfer_s(latency, bandwidth, sender, receiver, num_bytes):
    """:meth:`PlacementProblem.transfer_s`: nothing for no bytes."""
    if num_bytes > 0:
        return latency[sender, receiver] + num_bytes / bandwidth[sender, receiver]
    return 0.0


@numba.njit(inline="always", **_JIT)
def _add_steps(device, step_s, backward, resource, duration, dep_start, deps, t, k, m):
    """One step task per device after every backward of its chunks (from task ``t``, dependency ``k``); the tasks."""
    for d in range(step_s.shape[0]):
        resource[t], duration[t] = d, step_s[d]
        for c in range(device.shape[0]):
            if device[c] == d:
                deps[k : k + m] = backward[c]
                k += m
        dep_start[t + 1] = k
        t += 1
    return t
