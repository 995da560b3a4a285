"""The compatibility sweep (``benchmarks/compat.py``): its verdicts, its table, and a fast slice of it.

The whole sweep (every zoo family x five methods x world 2 and 4 x batch 4 and 8) runs from one command and
writes ``docs/compatibility.md``; CI runs the slice below: two families, two methods, world 2, batch 8 — models
as users write them that failed before (an LSTM language model with labels as targets, and
``GPT2LMHeadModel`` itself: tied embeddings, a ``ModelOutput`` the loss reads ``["logits"]`` of).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import compat
from planner.errors import REPORT_HINT, InternalError

ROOT = Path(__file__).resolve().parent.parent


def _done(stdout: str = "", stderr: str = "", code: int = 0) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(args=[], returncode=code, stdout=stdout, stderr=stderr)


def test_judge_reads_the_run() -> None:
    ok = "step 1  loss 1.0  parity match: ...\nstep 2  loss 0.9  parity match: ...\n"
    assert compat.judge(_done(ok), steps=2) == ("ok", "")
    bad = "step 1  loss 1.0  parity MISMATCH: loss diff 1e-2\n"
    assert compat.judge(_done(bad, code=1), steps=2)[0] == "mismatch"
    crashed = "[rank1]:rank 1 failed: RuntimeError: Connection closed by peer\n[rank0]:rank 0 failed: ValueError: x\n"
    assert compat.judge(_done(stderr=crashed, code=1), steps=2) == ("failed", "rank 0 failed: ValueError: x")
    assert compat.judge(_done(ok.splitlines()[0] + "\n"), steps=2)[0] == "failed"  # a step short is no pass


def test_markdown_has_one_row_per_family_and_one_cell_per_method_and_world() -> None:
    cells = [
        compat.Cell(family="a", method="auto", world=2, outcome="ok", message="", plan_s=1, run_s=1),
        compat.Cell(family="a", method="auto", world=4, outcome="refused", message="x | y", plan_s=1, run_s=0),
    ]
    text = compat.markdown(cells, methods=["auto"], worlds=[2, 4], header="# H")
    assert "| a | ✓ | refused: x \\| y |" in text and "**1 of 2 cells pass** (50.0%)" in text


def test_markdown_has_a_row_per_batch_when_the_sweep_ran_several() -> None:
    cells = [
        compat.Cell(family="a", method="auto", world=2, batch=batch, outcome=outcome, message="", plan_s=1, run_s=1)
        for batch, outcome in ((4, "ok"), (8, "failed"))
    ]
    text = compat.markdown(cells, methods=["auto"], worlds=[2], header="# H")
    assert "| a (batch 4) | ✓ |" in text and "| a (batch 8) | failed |" in text


def test_internal_errors_ask_for_a_bug_report() -> None:
    assert REPORT_HINT in str(InternalError("stage 0 broke"))


@pytest.mark.slow
def test_sweep_slice(tmp_path: Path) -> None:
    """Plan, run two steps and check parity for a slice of the zoo, as the whole sweep does (one family, one
    method: the sweep's machinery; the families themselves run in the sweep and the parity tests)."""
    out, data = tmp_path / "compat.md", tmp_path / "compat.json"
    command = [
        sys.executable,
        "-m",
        "benchmarks.compat",
        "--families",
        "hf_gpt2_lm_head",
        "--methods",
        "megatron",
        "--worlds",
        "2",
        "--batch-sizes",
        "8",
        "--out",
        str(out),
        "--json",
        str(data),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    cells = json.loads(data.read_text())["cells"]
    assert len(cells) == 1
    verdicts = [(c["family"], c["method"], c["outcome"], c["message"]) for c in cells]
    assert all(cell["outcome"] == "ok" for cell in cells), (verdicts, done.stdout[-2000:], done.stderr[-2000:])
    assert done.returncode == 0 and "| hf_gpt2_lm_head | ✓ |" in out.read_text()
