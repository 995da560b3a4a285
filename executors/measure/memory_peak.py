"""Peak memory of a rank during one training step on CPU, from the CPU allocator's own byte counter.

CPU tensors have no allocator statistics (``torch.cuda.max_memory_allocated`` has no CPU twin), but c10's CPU
allocator keeps a count of the bytes allocated and not yet freed when its ``caffe2_report_cpu_memory_usage``
flag is on (:func:`count_cpu_allocations`, set before the model is built), and
``torch.profiler.profile(profile_memory=True)`` reports that count with every allocation and free the profiled
threads make (:func:`allocation_events`). The count sees frees on every thread (gloo's threads drop the last
reference to a collective's buffers), which the events alone do not. One profile spans the building of the
rank's runner, the warm-up steps and the measured step (``record_function`` ranges mark the runner's start
and the step). With ``T`` the count, ``T₁`` its value when the runner starts to be built (the unsharded model
and the input batch already exist), ``T₀`` when the measured step starts and ``T_max`` the most it reaches
during the step (:func:`counter_peaks`), the rank's peak (:func:`rank_peak_bytes`) is

    peak = H + (T₀ − T₁) + (T_max − T₀)

* ``H`` (*held*): the storages of the parameters and optimizer state the runner holds at the step's start
  that are the model's own (built before ``T₁``: a DDP replica trains the model's parameters in place),
  each storage once (:func:`shared_bytes`);
* ``T₀ − T₁`` (*runner*): what building the runner and the warm-up steps allocated and still hold — sharded
  copies of the parameters, DDP's gradient buckets, FSDP's buffers, optimizer state made lazily;
* ``T_max − T₀`` (*step*): gradients, saved activations, transient outputs, workspace and communication
  buffers at the step's fullest moment, and the optimizer's update (SGD). Gradients were dropped by
  ``zero_grad(set_to_none=True)`` before the step.

This is what ``torch.cuda.max_memory_allocated`` reports for the same program on a GPU, less what the rank
built before its runner and the runner does not train: the rank's copy of the unsharded model (its tensors
are kept alive through the measurement so their blocks cannot be reused), module buffers the runner reads
in place (masks, rotary tables, batch-norm statistics: kilobytes here) and the input batch. Left out too:
the interpreter and torch's libraries, and blocks another thread allocates and frees between two events of
the profiled threads.

    python -m torch.distributed.run --nproc-per-node N -m executors.measure.memory_peak OUT STEPS PLAN...

writes ``{plan path: [peak bytes of rank 0, rank 1, ...]}`` (STEPS warm-up steps first; null where the plan
failed) and, beside OUT, ``OUT.parts.json`` = ``{plan path: [{"held": H, "runner": T₀ − T₁, "step": T_max − T₀}
or {"error": message}, ...]}`` per rank.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RUNNER_MARK = "autoplan::build_runner"
STEP_MARK = "autoplan::measured_step"
COUNTER_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"


def count_cpu_allocations() -> None:
    """Turn on c10's count of the CPU allocator's live bytes (the flag behind ``--caffe2_report_cpu_memory_usage``;
    it is a C++ flag with no Python setter, so it is set in ``libc10``). Blocks allocated before are never
    counted, not even when freed."""
    import ctypes
    import os

    import torch

    library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(library, COUNTER_FLAG).value = True


def peak_from_events(events: Iterable[tuple[int, int]]) -> int:
    """``max(0, max_k Σ_{i≤k} b_i)`` over ``(time, signed bytes)`` events sorted by time."""
    live = peak = 0
    for _, nbytes in sorted(events, key=lambda event: event[0]):
        live += nbytes
        peak = max(peak, live)
    return peak


@dataclass(frozen=True, kw_only=True, slots=True)
class Allocation:
    """One allocator event: ``nbytes`` allocated (> 0) or freed (< 0), and the allocator's count of live bytes
    just after it."""

    time_ns: int
    nbytes: int
    total_bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class CounterPeaks:
    """The allocator's count at the runner's start (``T₁``), the step's start (``T₀``), and its most in the step."""

    runner_start: int
    step_start: int
    step_peak: int


def counter_peaks(events: Iterable[Allocation], *, runner_ns: int, step: tuple[int, int]) -> CounterPeaks:
    """``T₁``, ``T₀`` and ``T_max`` (module docstring) from the events: the count just before the first event at or
    after ``runner_ns``, just before the first at or after ``step[0]``, and its most over the events in ``step``."""
    ordered = sorted(events, key=lambda event: event.time_ns)

    def before(time_ns: int) -> int:
        first = next((e for e in ordered if e.time_ns >= time_ns), None)
        if first is not None:
            return first.total_bytes - first.nbytes
        return ordered[-1].total_bytes if ordered else 0

    step_start = before(step[0])
    inside = [e.total_bytes for e in ordered if step[0] <= e.time_ns <= step[1]]
    return CounterPeaks(runner_start=before(runner_ns), step_start=step_start, step_peak=max([step_start, *inside]))


def allocation_events(profiler: object) -> tuple[list[Allocation], dict[str, tuple[int, int]]]:
    """The CPU allocator's events of a finished ``torch.profiler.profile`` and the ``(start, end)`` ns of each
    ``record_function`` range named by :data:`RUNNER_MARK` or :data:`STEP_MARK`."""
    from torch._C._profiler import _EventType

    events, ranges = [], {}
    stack = list(profiler.profiler.kineto_results.experimental_event_tree())  # type: ignore[attr-defined]
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and str(event.extra_fields.device) == "cpu":
            fields = event.extra_fields
            events.append(
                Allocation(time_ns=event.start_time_ns, nbytes=fields.alloc_size, total_bytes=fields.total_allocated)
            )
        elif event.name in (RUNNER_MARK, STEP_MARK):
            ranges[event.name] = (event.start_time_ns, event.end_time_ns)
    assert set(ranges) == {RUNNER_MARK, STEP_MARK}, f"marks missing from the profile: {sorted(ranges)}"
    return events, ranges


def step_peak_bytes(step: Callable[[], Any]) -> int:
    """The most bytes ``step()`` holds at once beyond what was allocated before it (``T_max − T₀``; the allocator's
    count is turned on first: :func:`count_cpu_allocations`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    count_cpu_allocations()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        with record_function(RUNNER_MARK):
            torch.ones(1)
        with record_function(STEP_MARK):
            torch.ones(1)
            step()
    events, ranges = allocation_events(profiler)
    found = counter_peaks(events, runner_ns=ranges[RUNNER_MARK][0], step=ranges[STEP_MARK])
    return found.step_peak - found.step_start


def shared_bytes(tensors: Iterable[Any], *, among: Iterable[Any]) -> int:
    """Bytes of the storages of ``tensors`` (DTensors: their local shards) that are storages of ``among`` too,
    each storage once."""
    from executors.training.memory_probe import storage_of

    built = {found[0] for found in map(storage_of, among) if found is not None}
    seen = dict(found for found in map(storage_of, tensors) if found is not None and found[0] in built)
    return sum(seen.values())


@dataclass(frozen=True, kw_only=True)
class RankProgram:
    """What :func:`rank_peak_bytes` measures: ``build_runner()`` makes the runner, ``step()`` one training step
    from zero gradients, ``state()`` the parameters and optimizer state the rank holds, ``built`` the tensors
    made before the runner (the model's and the batch's), ``storages`` theirs (holding them keeps the blocks
    alive whatever the runner does to the tensors)."""

    built: list[Any]
    storages: list[Any]
    build_runner: Callable[[], None]
    step: Callable[[], None]
    state: Callable[[], list[Any]]


def rank_peak_bytes(program: RankProgram, *, warmup: int) -> dict[str, int]:
    """``{"held": H, "runner": T₀ − T₁, "step": T_max − T₀}`` of this rank (the module docstring)."""
    import gc

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    gc.collect()  # what an earlier plan left in reference cycles goes now, not while this one is counted
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        with record_function(RUNNER_MARK):
            torch.ones(1)  # an event at the mark: the count before it is T₁
            program.build_runner()
        for _ in range(warmup):
            program.step()
        state = program.state()
        gc.collect()
        dist.barrier()
        with record_function(STEP_MARK):
            torch.ones(1)
            program.step()
    events, ranges = allocation_events(profiler)
    found = counter_peaks(events, runner_ns=ranges[RUNNER_MARK][0], step=ranges[STEP_MARK])
    return {
        "held": shared_bytes(state, among=program.built),
        "runner": found.step_start - found.runner_start,
        "step": found.step_peak - found.step_start,
    }


def measure_plans(paths: Sequence[str], *, warmup: int) -> dict[str, list[dict[str, Any]]]:
    """Every rank's parts of its peak over one profiled training step of each plan (after ``warmup`` steps), or
    ``{"error": ...}`` where the plan failed on that rank (the ranks must fail alike, or the job times out)."""
    import torch.distributed as dist

    parts = {}
    for path in paths:
        try:
            local: dict[str, Any] = rank_peak_bytes(plan_program(path), warmup=warmup)
        except Exception as error:  # a plan the executors cannot run: reported, the others still measured
            local = {"error": f"{type(error).__name__}: {error}"[:300]}
        gathered: list[dict[str, Any] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        parts[path] = [value or {"error": "no result"} for value in gathered]
    return parts


def plan_program(path: str) -> RankProgram:
    """A plan's runner as ``plan run`` builds it, trained with SGD (:class:`RankProgram`)."""
    from executors.precision import make_optimizer
    from executors.runner import Runner, make_runner
    from executors.session import load_workload
    from planner.plan import load_plan

    plan = load_plan(path)
    workload = load_workload(plan, seed=0, device="cpu")
    model, inputs = workload.build()
    made: dict[str, Any] = {}

    def build_runner() -> None:
        runner: Runner = make_runner(plan, workload, model)
        params = list(dict.fromkeys(runner.parameters()))
        made.update(runner=runner, params=params, optimizer=make_optimizer("sgd", params, lr=0.01) if params else None)

    def step() -> None:
        optimizer = made["optimizer"]
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        made["runner"].step(inputs)
        if optimizer is not None:
            optimizer.step()

    def state() -> list[Any]:
        optimizer, params = made["optimizer"], made["params"]
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)  # the measured step starts without gradients
        return [*params, *(v for p in params for v in (optimizer.state.get(p, {}).values() if optimizer else ()))]

    built = [*model.parameters(), *model.buffers(), *(x for x in inputs if hasattr(x, "untyped_storage"))]
    return RankProgram(
        built=built, storages=[t.untyped_storage() for t in built], build_runner=build_runner, step=step, state=state
    )


def main(argv: Sequence[str]) -> None:
    from executors.session import rank_job

    count_cpu_allocations()
    found: dict[str, list[dict[str, Any]]] = {}

    def measure(paths: list[str], warmup: int) -> dict[str, list[int | None]]:
        found.update(measure_plans(paths, warmup=warmup))
        return {
            path: [None if "error" in part else sum(part.values()) for part in ranks] for path, ranks in found.items()
        }

    if rank_job(argv, measure):
        Path(f"{argv[0]}.parts.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main(sys.argv[1:])
