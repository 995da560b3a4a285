"""Planning, compiling and launching the training program for ``benchmarks/gpu_check.py``, and reading its log.

Every step is the command a user runs, in a subprocess of its own session (so a time limit ends the whole
process group, torchrun's workers included):

* ``python -m planner MODEL_FILE --cluster FILE --batch-size B --model-arg k=v ... --out PLAN`` (planning
  imports highspy and pulp: on the GPU machine they come from the carried wheels);
* ``python -m planner compile PLAN --out DIR``;
* ``python -m torch.distributed.run --standalone --nproc-per-node 1 DIR/train.py ...``.

:class:`Context` is what the check's sections share. This module imports nothing of autoplan (and no torch),
so the check starts, and records what failed, even where autoplan's own modules do not import.

:func:`parse_steps` reads the program's per-step lines (:class:`executors.training.train_log.StepLogger`):
step, loss, step time, ``memory X MiB (plan Y MiB)`` under ``--measure-memory``, ``CUDA peak X MiB
allocated, Y MiB reserved`` on CUDA, and the parity verdict under ``--check-parity``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
_STEP = re.compile(r"^step (\d+)  loss (\S+)  ([\d.]+) (ms|s) \(plan")
_MEMORY = re.compile(r"  memory ([\d.]+) MiB \(plan")
_CUDA_PEAK = re.compile(r"  CUDA peak ([\d.]+) MiB allocated, ([\d.]+) MiB reserved")
_PARITY = re.compile(r"  parity (match|MISMATCH)")


@dataclass(frozen=True, kw_only=True)
class StepLine:
    step: int
    loss: float
    step_time_s: float
    memory_bytes: float | None = None  # model state + peak saved activations (--measure-memory)
    allocated_bytes: float | None = None  # torch.cuda.max_memory_allocated (CUDA)
    reserved_bytes: float | None = None  # torch.cuda.max_memory_reserved (CUDA)
    parity_ok: bool | None = None


def parse_steps(text: str) -> list[StepLine]:
    """The program's step lines in ``text`` (other lines are ignored)."""
    steps = []
    for line in text.splitlines():
        found = _STEP.match(line)
        if found is None:
            continue
        scale = 1e-3 if found.group(4) == "ms" else 1.0
        memory, peak, parity = _MEMORY.search(line), _CUDA_PEAK.search(line), _PARITY.search(line)
        steps.append(
            StepLine(
                step=int(found.group(1)),
                loss=float(found.group(2)),
                step_time_s=float(found.group(3)) * scale,
                memory_bytes=float(memory.group(1)) * MIB if memory else None,
                allocated_bytes=float(peak.group(1)) * MIB if peak else None,
                reserved_bytes=float(peak.group(2)) * MIB if peak else None,
                parity_ok=(parity.group(1) == "match") if parity else None,
            )
        )
    return steps


@dataclass(frozen=True, kw_only=True)
class Done:
    """A finished command: exit code (None: ended at its time limit), seconds, its output."""

    returncode: int | None
    seconds: float
    output: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def tail(self, lines: int = 12) -> str:
        return "\n".join(self.output.strip().splitlines()[-lines:])

    def describe(self) -> str:
        status = "timed out" if self.returncode is None else f"exit {self.returncode}"
        return f"{status} after {self.seconds:.1f} s: {self.tail(3)}"


def environment() -> dict[str, str]:
    """This checkout (and whatever the caller's PYTHONPATH adds, e.g. the wheels' folder) on the path."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1"}


def run_command(command: Sequence[str], *, timeout_s: float, log: Callable[[str], None]) -> Done:
    """Run ``command`` in its own session; at ``timeout_s`` its whole process group is ended."""
    log("$ " + " ".join(command))
    started = time.monotonic()
    process = subprocess.Popen(
        list(command),
        cwd=ROOT,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=max(timeout_s, 1.0))
        code: int | None = process.returncode
    except subprocess.TimeoutExpired:
        _end_group(process)
        output, _ = process.communicate()
        code = None
    done = Done(returncode=code, seconds=time.monotonic() - started, output=output or "")
    log(done.output.rstrip() + f"\n[{done.describe().split(':')[0]}]")
    return done


def _end_group(process: subprocess.Popen) -> None:
    """SIGTERM to the command's process group, SIGKILL after 10 s."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


@dataclass(frozen=True, kw_only=True)
class ModelRun:
    """What to plan: a model file, its ``--model-arg``s and the global batch."""

    name: str
    model_file: str
    model_args: tuple[tuple[str, Any], ...]
    batch_size: int

    def plan_args(self) -> list[str]:
        args = [self.model_file, "--batch-size", str(self.batch_size)]
        for key, value in self.model_args:
            args += ["--model-arg", f"{key}={value}"]
        return args


def plan_and_compile(
    run: ModelRun, *, cluster_file: Path, work: Path, timeout_s: float, log: Callable[[str], None]
) -> tuple[Path, Done]:
    """Plan ``run`` on the cluster file and compile it into ``work/NAME``; returns the program's path and the
    planning command's result (its summary). Raises RuntimeError naming the step that failed."""
    deadline = time.monotonic() + timeout_s
    plan_path = work / f"plan-{run.name}.json"
    planned = run_command(
        [sys.executable, "-m", "planner", *run.plan_args(), "--cluster", str(cluster_file), "--out", str(plan_path)],
        timeout_s=timeout_s,
        log=log,
    )
    if not planned.ok:
        raise RuntimeError(f"planning {run.name} failed ({planned.describe()})")
    program_dir = work / f"program-{run.name}"
    compiled = run_command(
        [sys.executable, "-m", "planner", "compile", str(plan_path), "--out", str(program_dir)],
        timeout_s=deadline - time.monotonic(),
        log=log,
    )
    if not compiled.ok:
        raise RuntimeError(f"compiling {run.name} failed ({compiled.describe()})")
    return program_dir / "train.py", planned


def launch(program: Path, args: Sequence[str], *, timeout_s: float, log: Callable[[str], None]) -> Done:
    """``torchrun --standalone --nproc-per-node 1 PROGRAM ARGS``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(program)]
    return run_command([*command, *args], timeout_s=timeout_s, log=log)


@dataclass(kw_only=True)
class Context:
    """What the sections share: the device, its cluster (and its file), the work folder, compiled programs."""

    cuda: bool
    cluster: Any  # cost_models.cluster.Cluster
    cluster_file: Path
    work: Path
    log: Callable[[str], None]
    programs: dict[ModelRun, tuple[Path, Done]]

    @property
    def device(self) -> str:
        return "cuda:0" if self.cuda else "cpu"

    @property
    def backend(self) -> str:
        return "nccl" if self.cuda else "gloo"

    def program(self, run: ModelRun, *, deadline: float) -> tuple[Path, Done]:
        """``run`` planned and compiled once per check (the dry run's CUDA path reuses its step program)."""
        if run not in self.programs:
            self.programs[run] = plan_and_compile(
                run, cluster_file=self.cluster_file, work=self.work, timeout_s=deadline - time.monotonic(), log=self.log
            )
        return self.programs[run]
