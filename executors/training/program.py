"""The training program of a plan: ``plan compile`` writing it.

:func:`write_program` writes ``DIR/train.py`` (the text is :data:`executors.training.program_template.TEMPLATE`:
a page of plain code that imports :mod:`executors.training.runtime` for the parallel parts) beside
``DIR/plan.json``; ``plan run`` launches the same file with torchrun.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from string import Template
from typing import Any

from executors.precision import describe_optimizer
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
    write_text_atomic(
        program, program_text(plan_with_path, model_file=model_file, program=program), what="training program"
    )
    return program


def program_text(plan: Plan, *, model_file: Any, program: Path) -> str:
    """The ``train.py`` of ``plan`` (its model file already loaded)."""
    from planner.plan.shape import plan_shape

    note = multi_node_note(plan.cluster)
    has_loss = model_file.loss_fn is not None
    return Template(TEMPLATE).substitute(
        method=plan.method,
        model_name=Path(str(plan.model.file)).name,
        shape=plan_shape(plan),
        devices=plan.cluster.num_devices,
        launch=torchrun_command(plan.cluster, str(program), args="--steps 100"),
        launch_note=f"\n({note})\n" if note else "",
        model_file=plan.model.file,
        model_args=repr(build_kwargs(model_file, dict(plan.model.args))),
        optimizer=plan.optimizer,
        optimizer_text=describe_optimizer(plan.optimizer),
        loss_call="MODEL_FILE.loss_fn(output, targets)"
        if has_loss
        else "runtime.default_loss(output, targets)  # the model file has no loss_fn: the mean of the output",
        loss_data="`targets` are the batch's targets"
        if model_file.has_targets
        else "`targets` are the batch's inputs (the model file has no example_targets)",
    )
