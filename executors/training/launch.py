"""``plan run``: start one process per device of a plan with torch.distributed's launcher.

:func:`launch` checks everything it can before starting anything (the plan file, the options, the
model file and its fingerprint — one clear error, exit 2, nothing started), says which program it runs
(:func:`executors.training.program.describe_program`) — a compiled directory's own ``train.py``, edits
included, or for a bare plan file the stock program written by
:func:`executors.training.program.write_program` into a temporary directory (so ``plan run``
and a compiled ``train.py`` are the same code path) — and runs it under torchrun's elastic agent
(``torch.distributed.launcher.api.elastic_launch``) on this machine, one process per device of the
plan, no restarts. When a rank fails the agent stops every other rank (SIGTERM, then
SIGKILL) and :func:`launch` prints one line naming the failing rank; ranks that hang are ended by
the process-group timeout (``--timeout-s``), so no run waits forever and no process outlives it.

:func:`check_host` refuses, in one line, a GPU plan this machine cannot host (too few CUDA devices,
or several nodes). For several machines, compile the program (``plan compile``) and start it with
torchrun on each node (the line ``plan compile`` prints; see the README).
:func:`crowded_cores_warning` is the one warning for CPU ranks that outnumber this machine's cores.

:func:`torchrun_argv` is the command that starts a script or module on this machine's processes under
torchrun: the timing job (:func:`executors.measure.step_timing.run_timing`), benchmarks and tests launch with it.
(:func:`planner.plan.launch.torchrun_command` is the line printed for a person, for the plan's cluster.)
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from executors.training.program import describe_program, program_to_run, write_program
from planner.errors import AutoplanError
from planner.ir.graph import OpGraph
from planner.plan import Plan, load_plan
from planner.plan.launch import backend_for
from planner.plan.schedules import Schedule

EXIT_USAGE = 2


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun_argv(
    *, world: int, program: str | Path | None = None, module: str | None = None, args: Sequence[object] = ()
) -> list[str]:
    """The command that starts ``program`` (a script) or ``module`` (``python -m``) with ``args`` on ``world``
    processes of this machine under torchrun (``python -m torch.distributed.run``), meeting at a free port."""
    if (program is None) == (module is None):
        raise ValueError("torchrun_argv starts a program or a module: give exactly one")
    target = [str(program)] if module is None else ["-m", module]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world)]
    return [*launcher, "--master-port", str(free_port()), *target, *map(str, args)]


def preflight(plan: Plan) -> OpGraph:
    """Check the model file builds the model the plan was made for (checked once here, again on every
    rank); returns its graph at the plan's microbatch size."""
    from executors.parallel.pipeline import check_pipeline
    from executors.runner import check_grad_sync
    from executors.session import load_workload

    if len(plan.stages) > 1 and plan.schedule != Schedule.DATAFLOW:
        check_pipeline(plan)
    check_grad_sync(plan)  # a lossy choice the plan's executor cannot run as priced (a hand-edited plan)
    return load_workload(plan, seed=0, device="cpu").graph_at(plan.batch_size // plan.num_microbatches)


def crowded_cores_warning(num_ranks: int, *, cores: int, backend: str | None) -> str | None:
    """One warning for CPU ranks that outnumber this machine's cores: they take turns, so the measured step
    says little about the plan (the losses and the parity check are unaffected); None otherwise."""
    if backend == "nccl" or num_ranks <= cores:
        return None
    return (
        f"{num_ranks} CPU processes share {cores} core(s) here: they take turns, so the step times will not mean "
        "much (losses and the parity check still do)"
    )


def check_host(plan: Plan, *, backend: str) -> None:
    """This machine can start every rank of the plan (one line naming what to do otherwise)."""
    cluster = plan.cluster
    if backend != "nccl":
        return  # CPU processes: any machine can host them (slowly when they outnumber its cores)
    if cluster.num_nodes > 1:
        raise AutoplanError(
            f"the plan spans {cluster.num_nodes} nodes of {cluster.devices_per_node} {cluster.device.name}: "
            "`plan run` starts one machine's processes; write the program with `plan compile PLAN --out DIR` and "
            "launch it on every node with the torchrun line it prints"
        )
    import torch

    found = torch.cuda.device_count()
    if found < cluster.devices_per_node:
        raise AutoplanError(
            f"the plan needs {cluster.devices_per_node} CUDA devices ({cluster.device.name}) on this machine, "
            f"it has {found}: run it on the plan's cluster, or pass --backend gloo to try it on CPU processes"
        )


def launch(
    target: str | Path,
    program_args: Sequence[str],
    *,
    backend: str | None = None,
    check_plan: Callable[[Plan, OpGraph], None] | None = None,
) -> int:
    """Run ``target`` on this machine — a compiled program's directory or its ``plan.json`` (that ``train.py``,
    edits included), or a plan file (the stock program: :func:`executors.training.program.program_to_run`) — and
    return the exit code (0 ok, 1 a rank failed or parity broke, 2 bad input). Prints which program runs first.
    ``check_plan(plan, graph at the microbatch size)`` raises AutoplanError for a plan that must not start."""
    chosen = program_to_run(Path(target))
    plan = load_plan(chosen.plan_path)
    effective = backend or backend_for(plan.cluster)
    check_host(plan, backend=effective)
    graph = preflight(plan)
    if check_plan is not None:
        check_plan(plan, graph)
    print(f"plan run: {describe_program(plan, chosen.program)}", flush=True)
    if chosen.warning:
        sys.stderr.write(f"plan run: warning: {chosen.warning}\n")
    crowded = crowded_cores_warning(plan.cluster.num_devices, cores=os.cpu_count() or 1, backend=effective)
    if crowded is not None:
        sys.stderr.write(f"plan run: warning: {crowded}\n")
    args = [*program_args, *(["--backend", backend] if backend else [])]
    if chosen.program is not None:
        return _elastic_run(chosen.program, args, nproc=plan.cluster.num_devices)
    with tempfile.TemporaryDirectory(prefix="autoplan-run-") as directory:
        program = write_program(plan, Path(directory))
        return _elastic_run(program, args, nproc=plan.cluster.num_devices)


def _elastic_run(program: Path, args: Sequence[str], *, nproc: int) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"autoplan-{os.getpid()}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        monitor_interval=0.5,
        rdzv_configs={"rank": 0},
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the ranks inherit it: one thread each unless told otherwise
    try:
        elastic_launch(config, sys.executable)("-u", str(program), *args)
    except ChildFailedError as error:
        # a rank killed by a signal is the cause; the ranks that then lost their peer exit on their own
        rank, failure = min(error.failures.items(), key=lambda item: (item[1].exitcode >= 0, item[1].timestamp))
        sys.stderr.write(f"plan run: rank {rank} failed ({_exit_text(failure.exitcode)}); every rank was stopped\n")
        codes = {f.exitcode for f in error.failures.values()}
        return EXIT_USAGE if codes == {EXIT_USAGE} else 1
    return 0


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
