"""The ``README.md`` of a compiled program directory (:func:`readme_text`).

It lists what the directory holds, what every node must have installed (the autoplan version that compiled it,
torch's supported range), how to run the program (``plan run``, ``launch.sh``, ``sbatch``), how a failed job
restarts and resumes, and ``train.py``'s flags as its own parser prints them (:func:`program_help` imports the
program just written and calls its ``parse_args(["--help"])``, so the README cannot list flags the program
does not have).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
from collections.abc import Iterator
from pathlib import Path

from executors.training.program_record import MODEL_FOLDER, RECORD, CompileRecord
from planner.plan import Plan
from planner.plan.launch import DEFAULT_MAX_RESTARTS, is_cpu_cluster
from planner.plan.shape import plan_shape

HELP_COLUMNS = 100


def program_help(program: Path) -> str:
    """``python train.py --help`` of ``program``, at :data:`HELP_COLUMNS` columns."""
    spec = importlib.util.spec_from_file_location(f"autoplan_program_{abs(hash(str(program.resolve())))}", program)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = io.StringIO()
    with _columns(HELP_COLUMNS), contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        module.parse_args(["--help"])
    return out.getvalue().rstrip("\n")


@contextlib.contextmanager
def _columns(width: int) -> Iterator[None]:
    """argparse wraps help at ``$COLUMNS``: a fixed width while the help is printed, restored after."""
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved


def readme_text(plan: Plan, *, program: Path, record: CompileRecord, python: str) -> str:
    """The README of the directory ``program`` sits in (see the module docstring)."""
    model_files = list(record.model_files)
    imports = model_files[1:]
    cluster = plan.cluster
    processes = f"{cluster.num_nodes} node(s) × {cluster.devices_per_node} {cluster.device.name}"
    version = record.autoplan or "(unknown: compiled from a checkout)"
    sections = [
        f"# Training program: the {plan.method} plan of {Path(model_files[0]).name}\n\n{plan_shape(plan)}, on "
        f"{processes}. Written by `plan compile` (autoplan {version}, torch {record.torch}); yours to edit.",
        _files_section(model_files[0], imports),
        _install_section(record, python=python, gpu=not is_cpu_cluster(cluster)),
        _run_section(multi_node=cluster.num_nodes > 1, cpu=is_cpu_cluster(cluster)),
        _resume_section(),
        f"## train.py's flags\n\n```text\n{program_help(program)}\n```",
    ]
    return "\n\n".join(sections) + "\n"


def _files_section(model_file: str, imports: list[str]) -> str:
    beside = f" and the files it imports ({', '.join(f'`{name}`' for name in imports)})" if imports else ""
    return f"""## What is here

- `train.py`: the program (model build, data loader, loss, optimizer, learning-rate schedule, clipping,
  checkpoints, logging); autoplan's runtime runs the parallel parts.
- `plan.json`: the plan (stages, meshes, shardings, microbatches, the estimate); it names its model file
  `{model_file}`, relative to this directory.
- `{MODEL_FOLDER}/`: `{Path(model_file).name}`{beside}, copied by `plan compile`.
- `launch.sh`: torchrun on the plan's node(s), restarting a failed job; `train.sbatch`: the same for Slurm.
- `{RECORD}`: what compiled it (autoplan and torch versions), the sha256 of every model file and of `train.py` as
  written (`plan run` says whether `train.py` was edited since).
- `README.md`: this file.

On start the program checks `{MODEL_FOLDER}/` against `{RECORD}`: a model file that changed stops it in one line
(re-plan and re-compile; the runtime also checks the rebuilt model against the plan's fingerprint). A model that
imports files by a name computed at run time, or reads data files beside it, needs those copied by hand."""


def _install_section(record: CompileRecord, *, python: str, gpu: bool) -> str:
    version = record.autoplan or "the version of the checkout that compiled it"
    gpu_line = "\n- CUDA and NCCL as your torch build needs them (one GPU per process)." if gpu else ""
    return f"""## Install on every node

- autoplan {version} (`pip install autoplan=={record.autoplan}`): the program refuses to start under another major or
  minor version (it names the one to install) and warns under another patch version.
- torch {record.torch_requirement} (compiled with {record.torch}), Python {python} or a compatible 3.11+.{gpu_line}"""


def _run_section(*, multi_node: bool, cpu: bool) -> str:
    here = "plan run . --steps 10 --check-parity   # from this directory: your edits run, on this machine's CPU"
    if not cpu:
        here += " (--backend gloo) or GPUs"
    nodes = (
        "MASTER_ADDR=first-node-address ./launch.sh -- --steps 1000 --checkpoint-dir ckpt   # on every node"
        if multi_node
        else "./launch.sh -- --steps 1000 --checkpoint-dir ckpt --checkpoint-every 100"
    )
    return f"""## Run it

```bash
{here}
{nodes}
sbatch train.sbatch -- --steps 1000 --checkpoint-dir ckpt --checkpoint-every 100   # Slurm, from this directory
```

Both launchers take `--max-restarts N` first (default {DEFAULT_MAX_RESTARTS}), then `--` and `train.py`'s flags.
Before torchrun they run `train.py --preflight` once (the Python in `PYTHON`, default `python3`): a mistake in the
flags, the model files or `parallelize()` stops the job there with one line, instead of once per restart.
`launch.sh` and `train.sbatch` name NCCL's environment variables (`NCCL_SOCKET_IFNAME`, `NCCL_IB_HCA`,
`NCCL_DEBUG`) in comments: set what your network needs before launching."""


def _resume_section() -> str:
    return """## Faults and resuming

A rank that fails stops the job; torchrun starts every process again, up to `--max-restarts` times. With
`--checkpoint-dir DIR`, `train.py` then resumes from the newest complete checkpoint there by itself
(`--auto-resume`, on by default): `DIR/latest` names a checkpoint only after every rank finished writing it, so
a checkpoint cut short by the failure is never loaded; every rank's random generators are restored with it, so
dropout draws the masks an uninterrupted run draws. The data loader restarts at `rank_info.start_step`: the
default synthetic batches are a function of the step, and your `make_dataloader` must serve batch `k` of the run
whether or not it was resumed (skip or seek to `start_step`), so no batch is skipped or seen twice."""
