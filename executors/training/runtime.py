"""The runtime a generated training program imports (``plan compile`` writes ``train.py``; see README).

The program keeps the model build, the data, the loss, the optimizer, the learning-rate schedule,
gradient clipping, checkpoints and logging in plain sight; this module gives it the parallel parts:

* :func:`start` — join the job torchrun started, with the plan's backend (nccl and one CUDA device
  per local rank for a GPU plan, gloo for CPU processes) unless told otherwise;
* :func:`parallelize` — this rank's part of the model (:class:`executors.training.parallel_model.ParallelModel`)
  in the run's precision (the plan's optimizer unless overridden; :mod:`executors.precision`), built from the
  program's ``parallelize`` section (:func:`executors.training.layout.stage`, :func:`~executors.training.layout.mesh`,
  :func:`~executors.training.layout.schedule`, :func:`~executors.training.layout.gradient_sync`) as
  :func:`executors.training.layout.resolve_layout` honours or refuses its edits; ``compile=True`` compiles each
  stage (:func:`executors.training.parallel_model.compile_stages`);
* :func:`export_hf` — ``--export-hf DIR``: the trained model as safetensors by the model's own names
  (:mod:`executors.training.export_hf`);
* :func:`synthetic_batches` — the default data: a new batch every step from the model file;
* :class:`StepTimer`, :class:`executors.training.train_log.StepLogger` — step time (slowest rank) and the log line;
* :func:`executors.training.checkpoint.save_checkpoint` / :func:`executors.training.checkpoint.load_checkpoint` —
  sharded DCP checkpoints;
* :class:`executors.training.parity_check.ParityCheck` — ``--check-parity`` against one process;
* :func:`run` — run ``main`` as one rank: a user error is one line naming the rank (exit 2), a crash
  one line (exit 1, the traceback with ``AUTOPLAN_DEBUG=1``), and the rank exits at once so its peers
  are stopped by torchrun instead of waiting for it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from executors.precision import Precision, check_optimizer, deviation, make_optimizer
from executors.session import default_loss, init_distributed
from executors.training.checkpoint import load_checkpoint, save_checkpoint
from executors.training.export_hf import check_safetensors, export_parallel_model
from executors.training.feed import RankInfo
from executors.training.feed import synthetic_batches as _synthetic
from executors.training.layout import (
    GradSyncSpec,
    LayoutEdit,
    ScheduleSpec,
    StageSpec,
    gradient_sync,
    mesh,
    resolve_layout,
    schedule,
    stage,
)
from executors.training.parallel_model import LossFn, ParallelModel
from executors.training.parallel_model import parallelize as _parallelize
from executors.training.parity_check import ParityCheck
from executors.training.program_record import check_program_dir
from executors.training.train_log import StepLogger, check_tensorboard, throughput_unit
from planner.errors import AutoplanError
from planner.ir.model_file import ModelFile
from planner.ir.model_file import load_model_file as _load_model_file
from planner.plan import Plan
from planner.plan import load_plan as _load_plan
from planner.plan.launch import backend_for

__all__ = [
    "ParityCheck",
    "RankInfo",
    "Session",
    "StepLogger",
    "StepTimer",
    "check_run_args",
    "default_loss",
    "export_hf",
    "gradient_sync",
    "load_checkpoint",
    "load_model_file",
    "load_plan",
    "make_optimizer",
    "mesh",
    "parallelize",
    "run",
    "save_checkpoint",
    "schedule",
    "stage",
    "start",
    "synthetic_batches",
    "throughput_unit",
]


def load_plan(path: str | Path) -> Plan:
    """The plan beside the program, after checking the directory's model files and autoplan's version against
    its ``compiled.json`` (:func:`executors.training.program_record.check_program_dir`); one line and exit code 2
    when it cannot be read or the check fails (the program's first lines call this, before :func:`run` can turn
    errors into lines)."""
    with _bad_input_exits():
        warning = check_program_dir(Path(path).parent)
        if warning and os.environ.get("RANK", "0") == "0":
            print(f"train.py: warning: {warning}", file=sys.stderr, flush=True)
        return _load_plan(path)


def load_model_file(plan: Plan) -> ModelFile:
    """The plan's model file, imported (``build_model``, ``example_inputs``, ``loss_fn``, ...); a missing or
    moved file is one line and exit code 2, as in :func:`load_plan`."""
    with _bad_input_exits():
        if plan.model.file is None:
            raise AutoplanError(
                "the plan has no model file (it was planned from Python): plan it with the `plan` command"
            )
        return _load_model_file(plan.model.file)


@contextlib.contextmanager
def _bad_input_exits() -> Iterator[None]:
    """An AutoplanError inside is the user's to fix: one ``train.py: error: ...`` line (from rank 0 only, as every
    rank hits it), exit code 2, no traceback."""
    try:
        yield
    except AutoplanError as error:
        if os.environ.get("RANK", "0") == "0":
            print(f"train.py: error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


@dataclass(frozen=True, kw_only=True)
class Session:
    plan: Plan
    rank: int
    world_size: int
    backend: str
    device: str
    preflight: bool = False  # --preflight: no process group; parallelize checks its section and builds nothing


def preflight(plan: Plan, parallelize: Callable[[Session], object]) -> int:
    """``train.py --preflight``, which ``launch.sh`` and ``train.sbatch`` run once before torchrun: the plan, the
    model files, the options (all checked before this is called) and the ``parallelize`` section (``parallelize``
    called with a session that builds nothing) in this one process, without a process group. A mistake is one line
    and exit code 2 here, said once, instead of once per torchrun restart; 0 when there is none."""
    session = Session(
        plan=plan,
        rank=0,
        world_size=plan.cluster.num_devices,
        backend=backend_for(plan.cluster),
        device="cpu",
        preflight=True,
    )
    parallelize(session)
    return 0


def start(plan: Plan, *, backend: str | None = None, timeout_s: float = 60.0) -> Session:
    """Join the job (torchrun's environment) with the plan's backend, or ``backend`` when given."""
    chosen = backend or backend_for(plan.cluster)
    if chosen == "nccl" and not torch.cuda.is_available():
        raise AutoplanError(
            f"this plan is for {plan.cluster.device.name} GPUs (nccl) but this machine has no CUDA device: run it on "
            "the plan's cluster, or pass --backend gloo to try it on CPU processes"
        )
    rank, world = init_distributed(backend=chosen, timeout_s=timeout_s)
    if world != plan.cluster.num_devices:
        raise AutoplanError(
            f"the plan is for {plan.cluster.num_devices} devices ({plan.cluster.num_nodes} node(s) × "
            f"{plan.cluster.devices_per_node}) but {world} processes were started: use torchrun --nnodes "
            f"{plan.cluster.num_nodes} --nproc-per-node {plan.cluster.devices_per_node}"
        )
    device = f"cuda:{torch.cuda.current_device()}" if chosen == "nccl" else "cpu"
    return Session(plan=plan, rank=rank, world_size=world, backend=chosen, device=device)


def parallelize(
    session: Session,
    *,
    optimizer: str,
    seed: int = 0,
    build_model: Callable[[], nn.Module] | None = None,
    loss_fn: LossFn | None = None,
    check_parity: bool = False,
    model_file: ModelFile | None = None,
    stages: Sequence[StageSpec] | None = None,
    schedule: ScheduleSpec | None = None,
    grad_sync: GradSyncSpec | None = None,
    compile: bool = False,
) -> ParallelModel | None:
    """This rank's part of the plan's model, in the precision ``optimizer`` trains with, as the program's
    ``parallelize`` section says (``stages``, ``schedule``, ``grad_sync``; None: the plan's as it is). Says (rank 0)
    when the optimizer or the schedule is not the plan's, and that dropout is off when checking parity. Under
    ``--preflight`` (:func:`preflight`) it checks the section and returns None."""
    check_optimizer(optimizer)
    plan = session.plan
    if stages is not None and schedule is not None and grad_sync is not None:
        try:
            plan = resolve_layout(plan, stages=stages, schedule=schedule, grad_sync=grad_sync)
        except LayoutEdit as refused:  # every rank reads the same section: rank 0 says it, once
            if session.rank == 0:
                print(refused, file=sys.stderr, flush=True)
            _exit_now(2)
    if session.preflight:
        return None
    if session.rank == 0:
        _say_schedule(planned=session.plan, running=plan, where=schedule.where.text() if schedule else "")
        if compile:
            print("compiling each stage with torch.compile (the plan's estimate assumes eager kernels)", flush=True)
        print(f"training with {optimizer}: {Precision.for_optimizer(optimizer).describe()}", flush=True)
        note = deviation(planned=plan.optimizer, running=optimizer)
        if note:
            print(note, flush=True)
        if check_parity:
            print(
                "parity check against one process: dropout off and random draws fixed on both sides "
                "(random streams differ by design)",
                flush=True,
            )
    return _parallelize(
        plan,
        compile=compile,
        device=session.device,
        seed=seed,
        precision=Precision.for_optimizer(optimizer),
        dropout=not check_parity,
        loss_fn=loss_fn,
        build_model=build_model,
        model_file=model_file,
    )


def _say_schedule(*, planned: Plan, running: Plan, where: str) -> None:
    if (planned.schedule, planned.num_microbatches) != (running.schedule, running.num_microbatches):
        print(
            f"{where}: running schedule {running.schedule} with {running.num_microbatches} microbatches, edited from "
            f"the plan's {planned.schedule} with {planned.num_microbatches} (the plan's estimate is for the plan's)",
            flush=True,
        )


def export_hf(model: ParallelModel, out_dir: str | Path) -> Path | None:
    """``--export-hf DIR``: every rank calls it at the end of the run; rank 0 writes DIR and says so."""
    written = export_parallel_model(model, out_dir)
    if written is not None:
        print(f"exported the model to {written} (safetensors, the model's own parameter names)", flush=True)
    return written


def synthetic_batches(plan: Plan, info: RankInfo, *, model_file: ModelFile | None = None) -> Iterator[tuple[Any, ...]]:
    """A new random batch ``(*inputs, *targets)`` of ``info.rows`` rows every step, drawn from the model
    file's ``example_inputs``/``example_targets`` with a seed of (seed, step, data rank)."""
    return _synthetic(model_file or load_model_file(plan), info, model_args=dict(plan.model.args))


def check_run_args(args: Any) -> None:
    """The program's options make sense together (one clear line otherwise, exit 2)."""
    try:
        _check_run_args(args)
    except AutoplanError as error:
        print(f"train.py: error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _check_run_args(args: Any) -> None:
    if args.steps < 1:
        raise AutoplanError(f"--steps must be at least 1, got {args.steps}")
    if args.lr <= 0:
        raise AutoplanError(f"--lr must be positive, got {args.lr:g}")
    check_optimizer(args.optimizer)
    if (args.resume or args.stop_after or args.checkpoint_every) and args.checkpoint_dir is None:
        raise AutoplanError("--resume, --stop-after and --checkpoint-every need --checkpoint-dir DIR")
    if args.resume and args.check_parity:
        raise AutoplanError("--check-parity starts both sides from the initial weights: it cannot follow --resume")
    if args.backend not in (None, "gloo", "nccl"):
        raise AutoplanError(f"--backend must be gloo or nccl, got {args.backend!r}")
    if getattr(args, "tensorboard", None):
        check_tensorboard()
    export_dir = getattr(args, "export_hf", None)
    if export_dir is not None and Path(export_dir).exists() and not Path(export_dir).is_dir():
        raise AutoplanError(f"--export-hf {export_dir}: a file is in the way; name a directory")
    if export_dir is not None:
        check_safetensors()
    log_csv = getattr(args, "log_csv", None)
    if log_csv is not None and Path(log_csv).is_dir():
        raise AutoplanError(f"--log-csv {log_csv} is a directory: name a file")


class StepTimer:
    """Seconds of one step: from a barrier to the end of the slowest rank's optimizer step."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.started = 0.0
        self.left_out = 0.0

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Work inside is not part of the step's time (the parity check)."""
        begun = time.perf_counter()
        try:
            yield
        finally:
            self.left_out += time.perf_counter() - begun

    def start(self) -> None:
        self._sync()
        dist.barrier()
        self.started, self.left_out = time.perf_counter(), 0.0

    def stop(self) -> float:
        self._sync()
        elapsed = torch.tensor(time.perf_counter() - self.started - self.left_out, device=self.session.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    def _sync(self) -> None:
        if self.session.backend == "nccl":
            torch.cuda.synchronize()


def run(main: Callable[[], int]) -> NoReturn:
    """Run one rank's ``main`` and exit with its code; errors become one line on stderr naming the rank."""
    try:
        code = main()
        if dist.is_initialized():
            dist.destroy_process_group()
    except AutoplanError as error:
        print(f"rank {_rank()}: {error}", file=sys.stderr, flush=True)
        _exit_now(2)
    except Exception as error:  # the failing rank names itself; torchrun stops the others
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        print(f"rank {_rank()} failed: {type(error).__name__}: {first}", file=sys.stderr, flush=True)
        if os.environ.get("AUTOPLAN_DEBUG"):  # the whole traceback, for a bug report
            traceback.print_exc()
        _exit_now(1)
    sys.exit(code)


def _rank() -> str:
    return str(dist.get_rank()) if dist.is_initialized() else os.environ.get("RANK", "?")


def _exit_now(code: int) -> NoReturn:
    """Leave at once: a failed rank must not wait at interpreter exit for its process group's threads
    (peers blocked in a collective with it), or the run would hang until the collective timeout."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
