"""Measure one plan as its training program runs it: step time and peak memory per rank (``plan tune``'s job).

Each rank runs what a compiled ``train.py`` runs, with the same runtime calls (:mod:`executors.training.runtime`):
the plan's model part in the precision of the plan's optimizer, a new synthetic batch each step, ``zero_grad``,
the training step, gradient clipping of the global norm (1.0, the program's default), the optimizer step and
the plan's post-step sync. ``warmup`` steps, then ``steps`` timed steps, each from a barrier to the end of the
slowest rank (:class:`executors.training.runtime.StepTimer`); the result is their median.

Peak memory per rank: on a GPU, ``torch.cuda.max_memory_allocated`` over the timed steps (the caching
allocator's high-water mark of tensors); on CPU, which has no allocator counters, the rank's model state at the
start of one more step plus the most that step's allocations held at once, from the profiler's memory events
(:func:`executors.measure.memory_peak.step_peak_bytes`; what ``benchmarks/fidelity.py`` measures).

What else ran meanwhile: the share of all CPU time the VM's host stole and other processes took while the timed
steps ran (:func:`executors.measure.machine_load.machine_shares`), so a caller can keep the least disturbed of several
runs.

    python -m torch.distributed.run --nproc-per-node N -m executors.measure.measure_plan OUT PLAN STEPS WARMUP [BACKEND]

Rank 0 writes ``OUT``: ``{"step_times_s": [...], "median_s": ..., "peak_bytes": [per rank], "steal": ...,
"foreign": ..., "wall_s": ...}``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CLIP_NORM = 1.0  # the compiled program's default --max-grad-norm


def measure(plan_path: str, *, steps: int, warmup: int, backend: str | None) -> dict[str, Any] | None:
    """This rank's part of the measurement; the whole result on rank 0 (None on the others)."""
    import torch
    import torch.distributed as dist

    from executors.measure.machine_load import cpu_ticks, machine_shares, own_cpu_ticks
    from executors.measure.memory_peak import step_peak_bytes
    from executors.training import runtime
    from executors.training.memory_probe import model_state_bytes

    plan = runtime.load_plan(plan_path)
    session = runtime.start(plan, backend=backend, timeout_s=120.0)
    if session.backend != "nccl":
        torch.set_num_threads(1)
    model = runtime.parallelize(session, optimizer=plan.optimizer)
    optimizer = runtime.make_optimizer(plan.optimizer, model.parameters(), lr=1e-4)
    info = model.rank_info()
    batches = runtime.synthetic_batches(plan, info) if info.needs_data else None
    timer = runtime.StepTimer(session)

    def step() -> None:
        model.train_step(next(batches) if batches is not None else None)
        model.clip_grad_norm_(CLIP_NORM)
        optimizer.step()
        model.after_optimizer_step()

    times = []
    for index in range(warmup + steps):
        if index == warmup:
            ticks, ours, wall = cpu_ticks(), own_cpu_ticks(), time.perf_counter()
            if session.backend == "nccl":
                torch.cuda.reset_peak_memory_stats()
        timer.start()
        optimizer.zero_grad(set_to_none=True)
        step()
        elapsed = timer.stop()
        if index >= warmup:
            times.append(elapsed)
    used = torch.tensor(own_cpu_ticks() - ours, dtype=torch.float64, device=session.device)
    dist.all_reduce(used)  # every rank's CPU time over the timed steps
    shares = machine_shares(ticks, cpu_ticks(), ours_ticks=float(used))
    wall_s = time.perf_counter() - wall
    if session.backend == "nccl":
        peak = int(torch.cuda.max_memory_allocated())
    else:
        optimizer.zero_grad(set_to_none=True)  # the measured step starts without gradients, as a timed one does
        state = model_state_bytes(model.parameters(), optimizer)
        dist.barrier()
        peak = state + step_peak_bytes(step)
    peaks: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    if dist.get_rank() != 0:
        return None
    return {
        "step_times_s": times,
        "median_s": statistics.median(times),
        "peak_bytes": [int(p or 0) for p in peaks],
        "wall_s": wall_s,
        **shares,
    }


def main(argv: Sequence[str]) -> None:
    from executors.training import runtime

    out, plan_path, steps, warmup = argv[0], argv[1], int(argv[2]), int(argv[3])
    backend = argv[4] if len(argv) > 4 else None

    def run_rank() -> int:
        result = measure(plan_path, steps=steps, warmup=warmup, backend=backend)
        if result is not None:
            Path(out).write_text(json.dumps(result))
        return 0

    runtime.run(run_rank)


if __name__ == "__main__":
    main(sys.argv[1:])
