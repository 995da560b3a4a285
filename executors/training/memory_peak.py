"""Peak memory of a rank during one training step on CPU, from the profiler's allocation events.

CPU tensors have no allocator statistics (``torch.cuda.max_memory_allocated`` has no CPU twin), but
``torch.profiler.profile(profile_memory=True)`` records every allocation and free of the CPU
allocator as a ``[memory]`` event with its signed byte count. Over a step with events
``(t_i, b_i)`` sorted by time, the bytes the step holds at ``t_k`` are ``S_k = Σ_{i≤k} b_i`` and
the step's allocation peak is ``max(0, max_k S_k)`` (:func:`peak_from_events`). The rank's peak is

    peak = state₀ + max_k S_k

where ``state₀`` is what the rank holds when the step starts (:func:`executors.training.memory_probe.model_state_bytes`:
its parameter shards and optimizer state; gradients were dropped by ``zero_grad(set_to_none=True)``
before the step). ``S`` covers gradients, saved activations, transient outputs, workspace and
communication buffers allocated during the step. A block allocated before the profiler started and
freed during the step has no event (the profiler warns), so ``S`` can only overstate, never miss,
what the step adds. Left out: the interpreter, torch's libraries, the rank's copy of the unsharded
model built before its shards were taken, and the input batch.

    python -m torch.distributed.run --nproc-per-node N -m executors.training.memory_peak OUT STEPS PLAN...

writes ``{plan path: [peak bytes of rank 0, rank 1, ...]}`` (STEPS warm-up steps first).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence

MEMORY_EVENT = "[memory]"


def peak_from_events(events: Iterable[tuple[int, int]]) -> int:
    """``max(0, max_k Σ_{i≤k} b_i)`` over ``(time, signed bytes)`` events sorted by time."""
    live = peak = 0
    for _, nbytes in sorted(events, key=lambda event: event[0]):
        live += nbytes
        peak = max(peak, live)
    return peak


def profiler_memory_events(profiler: object) -> list[tuple[int, int]]:
    """``(start ns, signed bytes)`` of every ``[memory]`` event a finished ``torch.profiler.profile`` holds."""
    results = profiler.profiler.kineto_results  # type: ignore[attr-defined]
    return [(event.start_ns(), event.nbytes()) for event in results.events() if event.name() == MEMORY_EVENT]


def step_peak_bytes(step: object) -> int:
    """The allocation peak of one call of ``step()`` (a callable), from the profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        step()  # type: ignore[operator]
    return peak_from_events(profiler_memory_events(profiler))


def measure_plans(paths: Sequence[str], *, warmup: int) -> dict[str, list[int]]:
    """Every rank's peak bytes over one profiled training step of each plan (after ``warmup`` steps)."""
    import torch.distributed as dist

    peaks = {}
    for path in paths:
        local = _plan_peak(path, warmup=warmup)
        gathered: list[int | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        peaks[path] = [int(value or 0) for value in gathered]
    return peaks


def _plan_peak(path: str, *, warmup: int) -> int:
    """This rank's ``state₀ + max S`` for one plan (module docstring)."""
    import torch.distributed as dist

    from executors.precision import make_optimizer
    from executors.runner import make_runner
    from executors.session import load_workload
    from executors.training.memory_probe import model_state_bytes
    from planner.plan import load_plan

    plan = load_plan(path)
    workload = load_workload(plan, seed=0, device="cpu")
    model, inputs = workload.build()
    runner = make_runner(plan, workload, model)
    params = list(dict.fromkeys(runner.parameters()))
    optimizer = make_optimizer("sgd", params, lr=0.01) if params else None

    def step() -> None:
        runner.step(inputs)
        if optimizer is not None:
            optimizer.step()

    for _ in range(warmup):
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        step()
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)  # the measured step starts without gradients
    state = model_state_bytes(params, optimizer)
    dist.barrier()
    return state + step_peak_bytes(step)


def main(argv: Sequence[str]) -> None:
    from executors.session import rank_job

    rank_job(argv, lambda paths, warmup: measure_plans(paths, warmup=warmup))


if __name__ == "__main__":
    main(sys.argv[1:])
