"""The training program of a plan: ``plan compile`` writing it, ``plan run`` finding it.

:func:`write_program` writes a directory that is the program (:data:`PROGRAM_FILES`):

* ``train.py`` — :data:`executors.training.program_template.TEMPLATE`, a page of plain code that imports
  :mod:`executors.training.runtime` for the parallel parts;
* ``plan.json`` — the plan, naming its model file relative to the directory: ``model/<file>``;
* ``model/`` — the model file and the files beside it that it imports, copied
  (:func:`executors.training.program_record.copy_model_files`);
* ``launch.sh`` and ``train.sbatch`` — torchrun on the plan's nodes, and Slurm's batch script, both restarting a
  failed job (:func:`planner.plan.launch.launch_script`, :func:`planner.plan.launch.sbatch_script`);
* ``compiled.json`` — the versions and fingerprints the program checks on load
  (:mod:`executors.training.program_record`);
* ``README.md`` — what the directory holds, ``train.py``'s flags (its own ``--help``) and how to run it
  (:func:`executors.training.program_readme.readme_text`).

Nothing is written when the model file cannot be loaded. :func:`program_to_run` is what ``plan run TARGET``
runs: a compiled directory's own ``train.py``, edits included (``TARGET`` is the directory or its ``plan.json``;
the directory is checked against its ``compiled.json`` first), or, for a plan file with no program beside it, the
stock program written from the plan into a temporary directory; :func:`describe_program` is the line that says
which, and whether ``train.py`` is still the text ``plan compile`` wrote (its recorded sha256).
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, replace
from pathlib import Path
from string import Template
from typing import Any

import torch

from executors.precision import describe_optimizer
from executors.training.layout_text import parallelize_section
from executors.training.program_readme import readme_text
from executors.training.program_record import (
    MODEL_FOLDER,
    CompileRecord,
    check_program_dir,
    copy_model_files,
    installed_version,
    program_edited,
    sha256_text,
    torch_requirement,
    write_record,
)
from executors.training.program_template import TEMPLATE
from planner.atomic_file import write_text_atomic
from planner.errors import AutoplanError
from planner.ir.model_file import build_kwargs, load_model_file
from planner.plan import Plan, save_plan
from planner.plan.launch import launch_script, multi_node_note, sbatch_script, torchrun_command

PROGRAM_FILES = ("train.py", "plan.json", f"{MODEL_FOLDER}/", "launch.sh", "train.sbatch", "compiled.json", "README.md")


def write_program(plan: Plan, out_dir: Path) -> Path:
    """Write the program directory ``out_dir`` (see the module docstring); returns its ``train.py``."""
    if plan.model.file is None:
        raise AutoplanError("the plan has no model file: plan it with the `plan` command to compile it")
    model_path = Path(plan.model.file).resolve()
    model_file = load_model_file(model_path)  # one that does not load stops here, before anything is written
    out_dir.mkdir(parents=True, exist_ok=True)
    copied = copy_model_files(model_path, out_dir)
    inside = out_dir / next(iter(copied))
    local = replace(plan, model=replace(plan.model, file=inside.relative_to(out_dir).as_posix()))
    save_plan(local, out_dir / "plan.json")
    program = out_dir / "train.py"
    text = program_text(local, model_file=model_file)  # the copy is the same file: not imported again
    write_text_atomic(program, text, what="training program")
    for name, script in (("launch.sh", launch_script(plan.cluster)), ("train.sbatch", sbatch_script(plan.cluster))):
        write_text_atomic(out_dir / name, script, what=name)
        (out_dir / name).chmod(0o755)
    record = CompileRecord(
        autoplan=installed_version(),
        torch=torch.__version__,
        torch_requirement=torch_requirement(),
        train_py_sha256=sha256_text(text),
        model_files=copied,
    )
    write_record(out_dir, record)
    readme = readme_text(local, program=program, record=record, python=platform.python_version())
    write_text_atomic(out_dir / "README.md", readme, what="program README")
    for name in ("train.py", "plan.json", "compiled.json", "README.md"):
        (out_dir / name).chmod(0o644)  # the atomic writer's temporary file is private; these are for every node
    return program


@dataclass(frozen=True, kw_only=True)
class ProgramToRun:
    """The plan file ``plan run`` reads and the program it starts (None: the stock one, written from the plan);
    ``warning``: what checking the directory against its record found to say (a patch-version difference)."""

    plan_path: Path
    program: Path | None
    warning: str | None = None


def program_to_run(target: Path) -> ProgramToRun:
    """What ``plan run TARGET`` runs (see the module docstring); AutoplanError for a directory that is not a
    compiled program."""
    if target.is_dir():
        missing = [name for name in ("plan.json", "train.py") if not (target / name).is_file()]
        if missing:
            raise AutoplanError(
                f"{target} has no {' or '.join(missing)}: name a directory `plan compile --out` wrote, or a plan file"
            )
        return _checked(ProgramToRun(plan_path=target / "plan.json", program=target / "train.py"))
    beside = target.parent / "train.py"
    if target.name == "plan.json" and beside.is_file():
        return _checked(ProgramToRun(plan_path=target, program=beside))
    return ProgramToRun(plan_path=target, program=None)


def _checked(chosen: ProgramToRun) -> ProgramToRun:
    """A compiled directory whose model files or autoplan version break its record stops here (AutoplanError)."""
    return replace(chosen, warning=check_program_dir(chosen.plan_path.parent))


def describe_program(plan: Plan, program: Path | None) -> str:
    """The line ``plan run`` prints before it starts: which program runs, and whether it was edited."""
    if program is None:
        return (
            "program: the stock train.py written from the plan (synthetic batches); to run your own, "
            "`plan compile PLAN.json --out DIR`, edit DIR/train.py and `plan run DIR`"
        )
    edited = program_edited(program.parent, program)
    if edited is None:
        state = f"compiled by an earlier autoplan: no {program.parent / 'compiled.json'} to tell if it was edited"
    else:
        state = "edited since `plan compile`: your edits run" if edited else "as compiled"
    return f"program: {program} ({state})"


def program_text(plan: Plan, *, model_file: Any) -> str:
    """The ``train.py`` of ``plan`` (its model file already loaded): it names no absolute path, so a moved
    directory keeps its program."""
    from planner.plan.shape import plan_shape

    note = multi_node_note(plan.cluster)
    has_loss = model_file.loss_fn is not None
    return Template(TEMPLATE).substitute(
        method=plan.method,
        model_name=Path(str(plan.model.file)).name,
        shape=plan_shape(plan),
        devices=plan.cluster.num_devices,
        launch=torchrun_command(plan.cluster, "train.py", args="--steps 100"),
        launch_note=f"\n({note})\n" if note else "",
        model_file=plan.model.file,
        model_args=repr(build_kwargs(model_file, dict(plan.model.args))),
        optimizer=plan.optimizer,
        parallelize_section=parallelize_section(plan),
        optimizer_text=describe_optimizer(plan.optimizer),
        loss_call="MODEL_FILE.loss_fn(output, targets)"
        if has_loss
        else "runtime.default_loss(output, targets)  # the model file has no loss_fn: the mean of the output",
        loss_data="`targets` are the batch's targets"
        if model_file.has_targets
        else "`targets` are the batch's inputs (the model file has no example_targets)",
    )
