"""The training program of a plan: ``plan compile`` writing it, ``plan run`` finding it.

:func:`write_program` writes ``DIR/train.py`` (the text is :data:`executors.training.program_template.TEMPLATE`:
a page of plain code that imports :mod:`executors.training.runtime` for the parallel parts) beside
``DIR/plan.json``. :func:`program_to_run` is what ``plan run TARGET`` runs: a compiled directory's own
``train.py``, edits included (``TARGET`` is the directory or its ``plan.json``), or, for a plan file with no
program beside it, the stock program written from the plan into a temporary directory; :func:`describe_program`
is the line that says which.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from string import Template
from typing import Any

from executors.precision import describe_optimizer
from executors.training.layout_text import parallelize_section
from executors.training.program_template import TEMPLATE
from planner.atomic_file import write_text_atomic
from planner.errors import AutoplanError
from planner.ir.model_file import build_kwargs, load_model_file
from planner.plan import Plan, save_plan
from planner.plan.launch import multi_node_note, torchrun_command


def write_program(plan: Plan, out_dir: Path) -> Path:
    """Write ``out_dir/train.py`` and ``out_dir/plan.json``; returns the program's path."""
    if plan.model.file is None:
        raise AutoplanError("the plan has no model file: plan it with the `plan` command to compile it")
    model_path = Path(plan.model.file).resolve()
    plan_with_path = replace(plan, model=replace(plan.model, file=str(model_path)))
    model_file = load_model_file(model_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_plan(plan_with_path, out_dir / "plan.json")
    program = out_dir / "train.py"
    write_text_atomic(program, program_text(plan_with_path, model_file=model_file), what="training program")
    return program


@dataclass(frozen=True, kw_only=True)
class ProgramToRun:
    """The plan file ``plan run`` reads and the program it starts (None: the stock one, written from the plan)."""

    plan_path: Path
    program: Path | None


def program_to_run(target: Path) -> ProgramToRun:
    """What ``plan run TARGET`` runs (see the module docstring); AutoplanError for a directory that is not a
    compiled program."""
    if target.is_dir():
        missing = [name for name in ("plan.json", "train.py") if not (target / name).is_file()]
        if missing:
            raise AutoplanError(
                f"{target} has no {' or '.join(missing)}: name a directory `plan compile --out` wrote, or a plan file"
            )
        return ProgramToRun(plan_path=target / "plan.json", program=target / "train.py")
    beside = target.parent / "train.py"
    if target.name == "plan.json" and beside.is_file():
        return ProgramToRun(plan_path=target, program=beside)
    return ProgramToRun(plan_path=target, program=None)


def describe_program(plan: Plan, program: Path | None) -> str:
    """The line ``plan run`` prints before it starts: which program runs, and whether it was edited."""
    if program is None:
        return (
            "program: the stock train.py written from the plan (synthetic batches); to run your own, "
            "`plan compile PLAN.json --out DIR`, edit DIR/train.py and `plan run DIR`"
        )
    stock = program_text(plan, model_file=load_model_file(str(plan.model.file)))
    state = "as compiled" if program.read_text() == stock else "edited since `plan compile`: your edits run"
    return f"program: {program} ({state})"


def program_text(plan: Plan, *, model_file: Any) -> str:
    """The ``train.py`` of ``plan`` (its model file already loaded): the same text wherever it is written, so
    :func:`describe_program` can tell an edited program from a compiled one."""
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
