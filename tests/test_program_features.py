"""The compiled ``train.py``'s parallelize section, step logs, ``--compile`` and ``--export-hf``, run under torchrun.

* A pipeline plan's program with its schedule edited (1F1B with 2 microbatches -> GPipe with 4) runs the edit (it
  says so) and still matches one process; its steps go to a CSV file (the header once, one row per step); an edit of
  a stage's module range stops it with one line naming the line to change back; ``--tensorboard`` without the
  tensorboard package, and ``--export-hf`` naming a file, are one line each.
* ``--compile`` trains a data-parallel plan with ``torch.compile`` on each stage and matches one process.
* A Hugging Face GPT-2 trained 2 steps as a 2-stage pipeline is exported (``--export-hf``), read back with
  ``transformers.AutoModelForCausalLM.from_pretrained``, and every parameter equals (relative norm) the one-device
  plan's after the same steps, and the export of the run's checkpoint (:func:`export_checkpoint`).
"""

from __future__ import annotations

import csv
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cost_models.cluster import load_cluster
from executors.training.launch import torchrun_argv
from executors.training.program import write_program
from planner.api import plan_model_file

pytestmark = pytest.mark.slow  # every test here launches processes

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1"}


def _program(tmp_path: Path, name: str, model: str, *, world: int, **keywords: object) -> Path:
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=world)
    plan = plan_model_file(ROOT / "examples" / model, cluster, method="megatron", **keywords)
    return write_program(plan, tmp_path / name)


def _torchrun(program: Path, world: int, *args: str) -> subprocess.CompletedProcess:
    command = torchrun_argv(world=world, program=program, args=list(args))
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=ENV, cwd=ROOT)


def _plan_run(directory: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "planner", "run", str(directory), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=ENV, cwd=ROOT)


def test_schedule_edit_runs_structural_edit_is_refused_and_steps_go_to_csv(tmp_path: Path) -> None:
    program = _program(
        tmp_path,
        "gpt",
        "gpt.py",
        world=2,
        batch_size=8,
        model_args={"size": "tiny", "vocab": 64, "seq": 16},
        degrees=(1, 2, 1),
        microbatches=2,
        schedule="1f1b",
    )
    text = program.read_text()
    schedule_line = 'runtime.schedule("1f1b", microbatches=2, virtual_stages=1)'
    assert schedule_line in text
    program.write_text(text.replace(schedule_line, 'runtime.schedule("gpipe", microbatches=4, virtual_stages=1)'))
    log = tmp_path / "steps.csv"
    board = importlib.util.find_spec("tensorboard") is not None  # the `logs` extra (CI installs it)
    board_args = ("--tensorboard", str(tmp_path / "tb")) if board else ()
    run = _torchrun(program, 2, "--steps", "2", "--check-parity", "--log-csv", str(log), *board_args)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "running schedule gpipe with 4 microbatches, edited from the plan's 1f1b with 2" in run.stdout
    assert run.stdout.count("parity match") == 2, run.stdout
    rows = list(csv.DictReader(log.open()))
    assert [row["step"] for row in rows] == ["1", "2"]
    assert log.read_text().count("step,loss,step_time_s,tokens_per_s,lr,grad_norm") == 1
    losses = re.findall(r"^step \d+  loss (\S+)", run.stdout, re.M)
    assert [f"{float(row['loss']):.6f}" for row in rows] == losses
    if board:  # TensorBoard's own reader finds the same losses at the same steps
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "tb"))
        events.Reload()
        scalars = events.Scalars("train/loss")  # float32 values: the log's six decimals within rounding
        assert [event.step for event in scalars] == [1, 2]
        assert [event.value for event in scalars] == pytest.approx([float(loss) for loss in losses], abs=2e-6)

    edited = program.read_text().replace('modules=("blocks.1.ln_1", "lm_head")', 'modules=("blocks.1.ln_1", "ln_f")')
    program.write_text(edited)
    refused = _plan_run(program.parent, "--steps", "1")
    assert refused.returncode == 2, refused.stderr[-3000:]
    line = next(number for number, text in enumerate(edited.splitlines(), 1) if '"ln_f")' in text)
    assert re.search(
        rf"train\.py line {line - 2}: stage 1's module range is \('blocks\.1\.ln_1', 'ln_f'\)", refused.stderr
    )
    assert "Traceback" not in refused.stderr and refused.stderr.count("module range") == 1  # rank 0 says it once

    if importlib.util.find_spec("tensorboard") is None:
        command = [sys.executable, str(program), "--steps", "1", "--tensorboard", str(tmp_path / "tb")]
        no_board = subprocess.run(command, capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
        assert no_board.returncode == 2 and "--tensorboard needs the tensorboard package" in no_board.stderr
        assert "Traceback" not in no_board.stderr
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    command = [sys.executable, str(program), "--steps", "1", "--export-hf", str(in_the_way)]
    refused_export = subprocess.run(command, capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert refused_export.returncode == 2 and "a file is in the way" in refused_export.stderr


def test_compile_trains_each_stage_compiled_with_parity(tmp_path: Path) -> None:
    program = _program(tmp_path, "mlp", "mlp.py", world=2, batch_size=16, degrees=(1, 1, 2))
    run = _torchrun(program, 2, "--steps", "2", "--check-parity", "--compile")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "compiling each stage with torch.compile" in run.stdout
    assert run.stdout.count("parity match") == 2, run.stdout


def _relative_gap(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.detach().double(), expected.detach().double()
    return float((got - expected).norm() / (expected.norm() + 1e-6))


def test_export_hf_reads_back_as_the_one_device_model_after_the_same_steps(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from executors.training.export_hf import export_checkpoint
    from planner.ir.model_file import load_model_file

    common = {"batch_size": 4, "model_args": {"seq": 16, "vocab": 64}, "microbatches": 2}
    pipeline = _program(tmp_path, "pipe", "hf_gpt2.py", world=2, degrees=(1, 2, 1), schedule="1f1b", **common)
    single = _program(tmp_path, "one", "hf_gpt2.py", world=1, degrees=(1, 1, 1), **common)
    flags = ["--steps", "2", "--check-parity", "--lr", "0.01"]  # --check-parity: dropout off on both
    run = _torchrun(pipeline, 2, *flags, "--export-hf", str(tmp_path / "hf"), "--checkpoint-dir", str(tmp_path / "ck"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("parity match") == 2
    assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "hf").iterdir()}
    reference = _torchrun(single, 1, *flags, "--export-hf", str(tmp_path / "hf-one"))
    assert reference.returncode == 0, reference.stderr[-3000:]

    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    one_device = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf-one")
    model_file = load_model_file(ROOT / "examples" / "hf_gpt2.py")
    export_checkpoint(tmp_path / "ck", tmp_path / "hf-ck", build_model=lambda: model_file.build_model(seq=16, vocab=64))
    from_checkpoint = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf-ck")
    torch.manual_seed(0)
    initial = dict(model_file.build_model(seq=16, vocab=64).model.named_parameters())
    expected = dict(one_device.named_parameters())
    assert exported.lm_head.weight is exported.transformer.wte.weight  # tied, as transformers ties them
    for name, param in exported.named_parameters():
        assert _relative_gap(param, expected[name]) <= 1e-3, name
        assert _relative_gap(param, dict(from_checkpoint.named_parameters())[name]) <= 1e-6, name
    trained = [name for name, param in exported.named_parameters() if _relative_gap(param, initial[name]) > 1e-4]
    assert len(trained) == len(initial)  # every parameter moved: the export holds the trained model


def test_export_of_a_tensor_parallel_model_gathers_its_shards(tmp_path: Path) -> None:
    """A plain torch model sharded over 2 ranks: model.safetensors holds every parameter whole by the model's own
    names, equal to the run's checkpoint put back together in one process (DCP's resharding)."""
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    from executors.training.export_hf import export_checkpoint
    from planner.ir.model_file import load_model_file

    model_args = {"size": "tiny", "vocab": 64, "seq": 16}
    program = _program(tmp_path, "tp", "gpt.py", world=2, batch_size=8, model_args=model_args, degrees=(2, 1, 1))
    assert "Shard(" in program.read_text()
    out, checkpoints = tmp_path / "export", tmp_path / "ck"
    run = _torchrun(
        program, 2, "--steps", "1", "--lr", "0.01", "--export-hf", str(out), "--checkpoint-dir", str(checkpoints)
    )
    assert run.returncode == 0, run.stderr[-3000:]
    model_file = load_model_file(ROOT / "examples" / "gpt.py")
    build = lambda: model_file.build_model(**model_args)  # noqa: E731
    export_checkpoint(checkpoints, tmp_path / "from-checkpoint", build_model=build)
    exported = load_file(out / "model.safetensors")
    expected = load_file(tmp_path / "from-checkpoint" / "model.safetensors")
    names = {name for name, _ in build().named_parameters()}
    assert names <= set(exported) and set(exported) == set(expected)
    for name, tensor in exported.items():
        assert tensor.shape == expected[name].shape, name
        assert _relative_gap(tensor, expected[name]) <= 1e-6, name
