"""Time training steps of saved plans with our executors, one torchrun job for many plans.

Inside the job (:func:`time_plans`) every plan is built as ``plan run`` builds it
(:func:`executors.runner.make_runner`, SGD) and stepped ``warmup + steps`` times; each step starts
after a barrier and lasts until the slowest rank finishes it (max over ranks). The result per plan
is the median of the timed steps. :func:`run_timing` launches the job and returns ``{plan path:
seconds}``; ``plan calibrate`` uses it on its probes and ``benchmarks/fidelity.py`` on its cases.

What else ran meanwhile (:func:`machine_shares`): around each plan's timed steps rank 0 reads the
CPU tick counters of /proc/stat (``steal``: time the VM's host took; busy = total − idle − iowait −
steal) and every rank its own CPU time (``getrusage``, all threads); the job writes, beside OUT,
``OUT.machine.json`` = ``{plan path: {"steal": s/T, "foreign": (busy − ours)/T, "wall_s": ...}}``
with ``T`` the ticks of all cores over the plan's timed steps: the share of the machine the host and
other processes took while the plan was timed.

    python -m torch.distributed.run --nproc-per-node N -m executors.measure.step_timing OUT STEPS PLAN...
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from executors.measure.machine_load import cpu_ticks, machine_shares, own_cpu_ticks
from planner.errors import AutoplanError

WARMUP_STEPS = 3


MACHINE: dict[str, dict[str, float]] = {}  # plan path -> machine_shares of its timed steps (filled by time_plans)


def time_plans(paths: Sequence[str], *, steps: int, warmup: int = WARMUP_STEPS) -> dict[str, float]:
    """Median step seconds of each plan, in an initialised process group (slowest rank per step); what
    else ran on the machine meanwhile goes to :data:`MACHINE`."""
    import torch
    import torch.distributed as dist

    from executors.precision import make_optimizer
    from executors.runner import load_cpu_runner

    measured = {}
    for path in paths:
        _, runner, inputs = load_cpu_runner(path)
        params = list(dict.fromkeys(runner.parameters()))
        optimizer = make_optimizer("sgd", params, lr=0.01) if params else None
        times = []
        for step in range(warmup + steps):
            dist.barrier()
            if step == warmup:
                ticks, ours, wall = cpu_ticks(), own_cpu_ticks(), time.perf_counter()
            started = time.perf_counter()
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            runner.step(inputs)
            if optimizer is not None:
                optimizer.step()
            elapsed = torch.tensor(time.perf_counter() - started)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank does
            if step >= warmup:
                times.append(float(elapsed))
        used = torch.tensor(own_cpu_ticks() - ours, dtype=torch.float64)
        dist.all_reduce(used)  # every rank's CPU time over the timed steps
        MACHINE[path] = {
            **machine_shares(ticks, cpu_ticks(), ours_ticks=float(used)),
            "wall_s": time.perf_counter() - wall,
        }
        measured[path] = statistics.median(times)
    return measured


def run_timing(
    paths: Sequence[str],
    *,
    world: int,
    steps: int,
    out: Path,
    timeout_s: float = 1800.0,
    module: str = "executors.measure.step_timing",
) -> dict[str, Any]:
    """Launch one torchrun job of ``world`` processes (one thread each) timing every plan; ``module``:
    another job with the same arguments (``executors.measure.memory_peak``: peak memory per rank)."""
    from executors.training.launch import torchrun_argv

    command = torchrun_argv(world=world, module=module, args=[out, steps, *paths])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise AutoplanError(f"timing {len(paths)} plans on {world} processes took over {timeout_s:.0f} s") from None
    if done.returncode:
        raise AutoplanError(f"timing plans on {world} processes failed: {root_cause(done.stderr)}")
    return json.loads(out.read_text())


def root_cause(stderr: str) -> str:
    """The first worker's exception line (``[rank0]: ValueError: ...``), else the last error line."""
    lines = stderr.splitlines()
    raised = [line for line in lines if re.match(r"\[rank\d+\]: \w+(Error|Exception)\b", line)]
    errors = [line for line in lines if "Error" in line] or lines[-1:]
    return (raised or errors or ["no output"])[0 if raised else -1]


def main(argv: Sequence[str]) -> None:
    from executors.session import rank_job

    if rank_job(argv, lambda paths, steps: time_plans(paths, steps=steps)):
        Path(f"{argv[0]}.machine.json").write_text(json.dumps(MACHINE))


if __name__ == "__main__":
    main(sys.argv[1:])
