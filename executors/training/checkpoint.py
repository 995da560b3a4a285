"""Sharded checkpoints of a training run with ``torch.distributed.checkpoint`` (DCP).

One checkpoint is a directory ``DIR/step-N`` that every rank writes together (:func:`save_checkpoint`):

* ``model.<name>`` — each parameter by its name in the user's model, written by its reporter rank
  (:class:`executors.training.parallel_model.ParallelModel`), or for a DTensor by every rank of the
  reporter's mesh, each its shard (DCP stores shards and de-duplicates replicas);
* ``optim.<name>.<key>`` — the optimizer state of that parameter (``exp_avg``, ``exp_avg_sq``,
  ``step``, ``momentum_buffer``), laid out like the parameter;
* ``progress`` — the number of steps done, the world size, the optimizer's hyper-parameters per parameter
  group (the learning rate a schedule has set among them) and the schedule's state, as JSON;
* ``rng-rank<r>.pt`` beside DCP's files — rank r's random generators (CPU, and CUDA's on a GPU rank), written
  before ``latest`` names the checkpoint (:func:`_save_rng`): restored on load into the same world size
  (:func:`_restore_rng`), dropout draws after a resume the masks an uninterrupted run draws, so its losses
  are the uninterrupted run's.

:func:`load_checkpoint` reads it back into every rank's parameters and optimizer state, whatever
rank wrote them (DCP reshards on load), and returns the step to resume at (``required=False``: 0 when there
is no checkpoint yet, how ``train.py``'s ``--auto-resume`` starts a fresh run and resumes a restarted one).
Parameter names, not ranks, key the checkpoint, so a checkpoint of one plan loads into any plan of the same
model that holds the same parameters. ``DIR/latest`` names the newest complete checkpoint: it is written after
DCP's save returns on every rank, so an interrupted save is never resumed from (a ``step-N`` directory
without ``latest`` naming it, or without DCP's ``.metadata``, is never loaded).

Test hook: with the environment variable ``AUTOPLAN_TEST_KILL_DURING_SAVE=N`` (:data:`KILL_DURING_SAVE`) the
last rank SIGKILLs itself in the middle of saving ``step-N`` — after writing its shard, before DCP's metadata
and ``latest`` — on the job's first attempt only (torchrun's ``TORCHELASTIC_RESTART_COUNT`` unset or 0), so a
test can leave a half-written checkpoint deterministically (``tests/test_restart.py``). Never set it otherwise.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import DTensor

from executors.training.parallel_model import ParallelModel
from planner.atomic_file import write_text_atomic
from planner.errors import AutoplanError

LATEST = "latest"
DCP_METADATA = ".metadata"  # DCP writes it last, once every rank's shard is written
KILL_DURING_SAVE = "AUTOPLAN_TEST_KILL_DURING_SAVE"  # the test hook of the module docstring


def _writes(model: ParallelModel, name: str, param: torch.Tensor) -> bool:
    reporter = model.reporter[name]
    if isinstance(param, DTensor):
        return reporter in param.device_mesh.mesh.flatten().tolist()
    return reporter == model.rank


def _state(model: ParallelModel, optimizer: torch.optim.Optimizer, *, writing: bool) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for name, param in model.named_parameters().items():
        if writing and not _writes(model, name, param):
            continue
        state[f"model.{name}"] = param.data if not isinstance(param, DTensor) else param
        for key, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                state[f"optim.{name}.{key}"] = value
    return state


def save_checkpoint(
    directory: str | Path, *, model: ParallelModel, optimizer: torch.optim.Optimizer, step: int, scheduler: Any = None
) -> Path:
    """Write ``directory/step-<step>`` from every rank (a collective); returns its path."""
    root = Path(directory)
    target = root / f"step-{step}"
    state = _state(model, optimizer, writing=True)
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    progress = {
        "step": step,
        "world_size": dist.get_world_size(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "groups": groups,
    }
    state["progress"] = json.dumps(progress)  # one object, not flattened by DCP
    dcp.save(state, storage_writer=_writer(target, step=step))
    _save_rng(target)
    dist.barrier()
    if dist.get_rank() == 0:
        write_text_atomic(root / LATEST, f"step-{step}\n", what="checkpoint pointer")
    return target


class _KilledMidSave(FileSystemWriter):
    """The test hook's writer: writes this rank's shard, then the rank SIGKILLs itself."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        written = super().write_data(plan, planner)
        written.wait()
        os.kill(os.getpid(), signal.SIGKILL)
        return written


def _writer(target: Path, *, step: int) -> FileSystemWriter:
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    last_rank = dist.get_rank() == dist.get_world_size() - 1
    if os.environ.get(KILL_DURING_SAVE) == str(step) and first_attempt and last_rank:
        return _KilledMidSave(str(target))
    return FileSystemWriter(str(target))


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The checkpoint ``directory/latest`` names (None: no complete checkpoint yet)."""
    pointer = Path(directory) / LATEST
    if not pointer.is_file():
        return None
    path = Path(directory) / pointer.read_text().strip()
    if not (path / DCP_METADATA).is_file():
        raise AutoplanError(f"{pointer} names {path}, which is not a complete checkpoint (no {DCP_METADATA})")
    return path


def load_checkpoint(
    directory: str | Path | None,
    *,
    model: ParallelModel,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    required: bool = True,
) -> int:
    """Load the newest complete checkpoint under ``directory`` into this rank; returns the step to resume at.
    With ``required=False`` a missing directory or checkpoint is a fresh start (0), else an AutoplanError."""
    if directory is None and required:
        raise AutoplanError("--resume needs --checkpoint-dir DIR")
    path = latest_checkpoint(directory) if directory is not None else None
    if path is None:
        if required:
            raise AutoplanError(f"--resume: no checkpoint in {directory} (no {LATEST} file naming a step-N directory)")
        return 0
    _init_optimizer_state(model, optimizer)
    state = _state(model, optimizer, writing=False)
    state["progress"] = ""
    dcp.load(state, checkpoint_id=str(path))
    progress = json.loads(state["progress"])
    for group, saved in zip(optimizer.param_groups, progress["groups"], strict=True):
        group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})
    if scheduler is not None and progress["scheduler"] is not None:
        scheduler.load_state_dict(progress["scheduler"])
    if progress.get("world_size") == dist.get_world_size():
        _restore_rng(path)
    if dist.get_rank() == 0:
        print(f"resuming from {path} (step {progress['step']} done)", flush=True)
    return int(progress["step"])


def _rng_path(checkpoint: Path) -> Path:
    return checkpoint / f"rng-rank{dist.get_rank()}.pt"


def _save_rng(checkpoint: Path) -> None:
    """This rank's generators, written whole (a temporary file renamed) before ``latest`` names the checkpoint."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    path = _rng_path(checkpoint)
    partial = path.with_name(f"{path.name}.partial")
    torch.save({"cpu": torch.get_rng_state(), "cuda": cuda}, partial)
    os.replace(partial, path)


def _restore_rng(checkpoint: Path) -> None:
    path = _rng_path(checkpoint)
    if not path.is_file():  # a checkpoint written before generators were saved: the weights still load
        return
    states = torch.load(path, weights_only=True)
    torch.set_rng_state(states["cpu"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def _init_optimizer_state(model: ParallelModel, optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (a step with zero gradients, as torch's own DCP helpers do) so DCP has
    tensors to load into; the parameters it may move are overwritten by the load."""
    params = model.parameters()
    if not params or all(optimizer.state.get(p) for p in params):
        return
    saved = [p.grad for p in params]
    for param in params:
        param.grad = torch.zeros_like(param)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    for param, grad in zip(params, saved, strict=True):
        param.grad = grad
