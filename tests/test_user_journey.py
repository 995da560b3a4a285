"""Issue 34's "done when", as a new user goes: plan a Hugging Face GPT-2, compile it, edit the program's data loader
to train on a text file, run it with ``plan run DIR`` (checkpointing), continue it with ``torchrun`` (it resumes by
itself), export it to Hugging Face format and read it back with ``transformers``.

The resumed run's losses must equal an uninterrupted run's step by step (dropout stays on: the checkpoint carries the
random state, the edited loader seeks to ``rank_info.start_step``), and the export must equal the uninterrupted run's
parameters by relative norm.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from executors.training.launch import torchrun_argv
from planner.cli.main import main

pytestmark = pytest.mark.slow  # launches processes

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1"}
STOCK_LOADER = "    return runtime.synthetic_batches(PLAN, rank_info, model_file=MODEL_FILE)\n"
TEXT_LOADER = """    tokens = torch.tensor(list((HERE / "corpus.txt").read_bytes()), dtype=torch.long) % 64
    seq, step = 16, rank_info.start_step  # seek: the batch of step k is the one an uninterrupted run reads
    while True:
        first_row = step * rank_info.batch_size + rank_info.data_rank * rank_info.rows
        starts = [((first_row + row) * seq) % (len(tokens) - seq) for row in range(rank_info.rows)]
        yield (torch.stack([tokens[start : start + seq] for start in starts]),)
        step += 1
"""


def _losses(stdout: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in re.findall(r"step (\d+)\s+loss (\S+)", stdout)}


def _run(command: list[str]) -> subprocess.CompletedProcess:
    run = subprocess.run(command, capture_output=True, text=True, timeout=900, env=ENV, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run


def _relative_gap(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.detach().double(), expected.detach().double()
    return float((got - expected).norm() / (expected.norm() + 1e-6))


def test_edit_run_resume_export_and_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    plan_file, program_dir = tmp_path / "plan.json", tmp_path / "gpt2_train"
    model_args = ["--model-arg", "seq=16", "--model-arg", "vocab=64"]
    shape = ["--method", "megatron", "--degrees", "1,2,1", "--microbatches", "2", "--schedule", "1f1b"]
    cluster = ["--cluster", "local-cpu", "--devices-per-node", "2", "--batch-size", "4"]
    assert main([str(ROOT / "examples" / "hf_gpt2.py"), *cluster, *model_args, *shape, "--out", str(plan_file)]) == 0
    assert main(["compile", str(plan_file), "--out", str(program_dir)]) == 0

    program = program_dir / "train.py"
    assert STOCK_LOADER in program.read_text()
    program.write_text(program.read_text().replace(STOCK_LOADER, TEXT_LOADER))
    shutil.copy(ROOT / "README.md", program_dir / "corpus.txt")  # a real text file to train on

    checkpoints, exported = tmp_path / "checkpoints", tmp_path / "hf"
    plan_run = [sys.executable, "-m", "planner", "run", str(program_dir), "--steps", "2"]
    first = _run([*plan_run, "--", "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1"])
    assert "edited since `plan compile`: your edits run" in first.stdout
    assert (checkpoints / "latest").read_text().strip() == "step-2"

    torchrun = torchrun_argv(world=2, program=program, args=[])
    resumed = _run([*torchrun, "--steps", "4", "--checkpoint-dir", str(checkpoints), "--export-hf", str(exported)])
    assert "resuming from" in resumed.stdout
    reference_dir = tmp_path / "hf-uninterrupted"
    reference = _run([*torchrun, "--steps", "4", "--export-hf", str(reference_dir)])

    expected = _losses(reference.stdout)
    got = {**_losses(first.stdout), **_losses(resumed.stdout)}
    assert sorted(expected) == sorted(got) == [1, 2, 3, 4]  # no step skipped or run twice
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=1e-6), step

    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    uninterrupted = dict(transformers.AutoModelForCausalLM.from_pretrained(reference_dir).named_parameters())
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, as transformers ties them
    for name, param in model.named_parameters():
        assert _relative_gap(param, uninterrupted[name]) <= 1e-3, name
    tokens = torch.tensor(list((program_dir / "corpus.txt").read_bytes()[:64]), dtype=torch.long).view(4, 16) % 64
    with torch.no_grad():
        loss = model(input_ids=tokens, labels=tokens).loss
    assert torch.isfinite(loss) and float(loss) < 2 * torch.log(torch.tensor(64.0))
