"""``benchmarks/gpu_check.py``: its CPU dry run produces every section's measurements and predictions and a page;
a section that raises is recorded and the next one runs; the pieces the GPU run relies on and the dry run
cannot reach (the H200's cluster, the program's CUDA memory line, the allocator peak off CUDA).

No timing is asserted: the dry run's figures are CPU times against an H100's predictions.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.gpu_check import DEVICE_COMMAND, DEVICE_TIMEOUT_S, Section, device_call, run_sections
from benchmarks.gpu_check_device import H200_141GB, cluster_for, write_cluster
from benchmarks.gpu_check_program import parse_steps
from benchmarks.gpu_check_report import render, save
from cost_models.cluster import load_cluster
from cost_models.units import GIB, MIB
from executors.training.memory_probe import AllocatorPeak, allocator_peak
from executors.training.train_log import StepLogger, Throughput
from planner.plan import Estimate

ROOT = Path(__file__).resolve().parent.parent


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--budget-s", "1500", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "gpu_check.log").read_text().strip()
    return json.loads((out / "gpu_check.json").read_text())


@pytest.mark.slow  # the dry_run fixture runs the whole check in a process
def test_dry_run_measures_and_predicts_every_operator(dry_run: dict) -> None:
    section = dry_run["sections"]["operators"]
    assert section["status"] == "ok"
    kinds = {(row["kind"], row["pass"]) for row in section["rows"]}
    assert kinds >= {("linear", p) for p in ("fwd", "bwd", "dX", "dW")} | {
        (kind, p) for kind in ("attention", "layer_norm", "rms_norm") for p in ("fwd", "bwd")
    }
    for row in section["rows"]:
        assert _positive(row["predicted_s"]) and _positive(row["measured_s"]), row
        assert len(row["times_s"]) == 3


@pytest.mark.slow  # the dry_run fixture runs the whole check in a process
def test_dry_run_measures_the_program_and_the_plain_loop_against_their_estimates(dry_run: dict) -> None:
    section = dry_run["sections"]["steps"]
    assert section["status"] == "ok"
    (row,) = section["rows"]
    for part in ("program", "eager"):
        got = row[part]
        for key in ("predicted_step_s", "measured_step_s", "predicted_memory_bytes", "measured_memory_bytes"):
            assert _positive(got[key]), (part, key, got)
        assert len(got["step_times_s"]) == row["steps"]
    assert row["program"]["memory_source"] == "model state + saved activations"  # no CUDA in the dry run
    assert len(row["program"]["losses"]) == row["steps"]


@pytest.mark.slow  # the dry_run fixture runs the whole check in a process
def test_dry_run_walks_the_programs_checkpoint_resume_and_parity_path(dry_run: dict) -> None:
    section = dry_run["sections"]["cuda_path"]
    assert section["status"] == "ok"
    checks = {row["check"]: row for row in section["rows"]}
    assert len(checks) == 5 and all(row["ok"] for row in checks.values()), checks
    assert checks["resumed losses equal the uninterrupted run's"]["measured"] == 0.0  # same kernels on one CPU


@pytest.mark.slow  # the dry_run fixture runs the whole check in a process
def test_the_page_renders_every_table(dry_run: dict, tmp_path: Path) -> None:
    page = render(dry_run)
    for heading in (
        "# GPU check (dry run)",
        "## Operators",
        "## Training steps",
        "## The compiled program's CUDA path",
    ):
        assert heading in page
    assert page.count("| tiny |") == len(dry_run["sections"]["operators"]["rows"])
    written = save(dry_run, results=tmp_path)
    assert written.name == f"gpu-dry-run-{dry_run['started'][:10]}.md" and written.read_text() == page


def test_a_section_that_raises_is_recorded_and_the_next_runs() -> None:
    def broken(deadline: float) -> list[dict]:
        raise RuntimeError("no flash kernel")

    result: dict = {"sections": {}}
    saves: list[int] = []
    sections = [
        Section(name="first", share=1.0, run=broken),
        Section(name="second", share=1.0, run=lambda deadline: [{"deadline": deadline}]),
    ]
    run_sections(sections, budget_s=60, result=result, save_result=lambda: saves.append(1), log=lambda _: None)
    first, second = result["sections"]["first"], result["sections"]["second"]
    assert first["status"] == "failed" and first["error"] == "RuntimeError: no flash kernel" and first["rows"] == []
    assert second["status"] == "ok" and len(second["rows"]) == 1
    assert len(saves) == 2


def test_a_section_past_the_budget_is_skipped() -> None:
    result: dict = {"sections": {}}
    sections = [Section(name="late", share=1.0, run=lambda deadline: [{}])]
    run_sections(sections, budget_s=0, result=result, save_result=lambda: None, log=lambda _: None)
    assert result["sections"]["late"]["status"] == "skipped"


def test_an_h200_is_an_h100_chip_with_its_data_sheet_memory(tmp_path: Path) -> None:
    h200 = cluster_for("NVIDIA H200").cluster
    h100 = cluster_for("NVIDIA H100 80GB HBM3").cluster
    assert h200.device == H200_141GB and h200.num_devices == h100.num_devices == 1
    assert (h200.device.memory_bytes, h200.device.memory_bandwidth) == (141 * GIB, 4.8e12)
    assert h200.device.kernels == h100.device.kernels and h200.device.peak_flops == h100.device.peak_flops
    assert "not a known GPU" in cluster_for("NVIDIA B200").note
    assert load_cluster(str(write_cluster(h200, tmp_path / "h200.json"))) == h200  # what the plans are made on


def test_the_programs_cuda_memory_line_is_read_back() -> None:
    """The line the compiled program prints on CUDA (StepLogger) parses back to its step time and both peaks."""
    estimate = Estimate(
        step_time_s=0.1,
        per_stage_time_s=(0.1,),
        memory_per_device_bytes=1000 * MIB,
        bubble_fraction=0.0,
        tflops_per_device=100.0,
        mfu=0.1,
    )
    logger = StepLogger(SimpleNamespace(estimate=estimate), throughput=Throughput(unit="tokens", per_step=8192))
    peak = AllocatorPeak(allocated_bytes=1500 * MIB, reserved_bytes=1600 * MIB)
    line = logger.line(
        step=2, loss=6.25, step_time_s=0.1234, lr=1e-4, grad_norm=1.0, memory_bytes=1200 * MIB, allocator_peak=peak
    )
    assert "CUDA peak 1500.0 MiB allocated, 1600.0 MiB reserved (plan 1000.0 MiB)" in line
    (step,) = parse_steps("training with adam-mixed\n" + line + "\n")
    assert step.step == 3 and step.loss == pytest.approx(6.25) and step.step_time_s == pytest.approx(0.1234)
    assert step.allocated_bytes == pytest.approx(1500 * MIB) and step.reserved_bytes == pytest.approx(1600 * MIB)
    assert step.memory_bytes == pytest.approx(1200 * MIB) and step.parity_ok is None
    without = parse_steps(logger.line(step=0, loss=1.0, step_time_s=12.5, lr=1e-4))
    assert without[0].step_time_s == pytest.approx(12.5) and without[0].allocated_bytes is None


def test_no_allocator_peak_off_cuda() -> None:
    assert allocator_peak("cpu") is None


def test_the_documented_device_call_is_the_scripts_and_fits_one_run_call() -> None:
    assert len(DEVICE_COMMAND) < 2000 and DEVICE_TIMEOUT_S <= 8 * 60
    assert DEVICE_COMMAND in (ROOT / "benchmarks" / "results" / "README.md").read_text()
    assert "--out $OUT" in DEVICE_COMMAND and "--target /tmp/site" in DEVICE_COMMAND
    assert subprocess.run(["bash", "-n", "-c", DEVICE_COMMAND]).returncode == 0
    assert json.loads(device_call())["carry"] == [".whl"]


def test_a_failed_setup_still_renders_a_page_that_says_so() -> None:
    result = {
        "machine": {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "python": "3.12.3"},
        "started": "2026-12-01T00:00:00",
        "budget_s": 400,
        "sections": {},
        "setup_error": "ImportError: cannot import name 'x'",
    }
    page = render(result)
    assert "Setup failed: ImportError: cannot import name 'x'" in page and "NVIDIA H200" in page


@pytest.mark.slow  # the dry_run fixture runs the whole check in a process
def test_rows_that_failed_or_ran_out_of_time_are_on_the_page(dry_run: dict) -> None:
    result = json.loads(json.dumps(dry_run))
    operators = result["sections"]["operators"]["rows"]
    operators.append({"model": "llama-8b", "op": "attention", "kind": "attention", "shape": "B2", "error": "OOM"})
    operators.append({"model": "llama-8b", "op": "lm_head", "kind": "linear", "shape": "8192", "skipped": "time"})
    result["sections"]["steps"]["rows"][0]["program"] = {"error": "RuntimeError: planning gpt-tiny failed"}
    page = render(result)
    assert "| llama-8b | attention | B2 | — | — | — | OOM | — |" in page and "| time |" in page
    assert "| gpt-tiny | 4 | program | RuntimeError: planning gpt-tiny failed |" in page
    assert "| gpt-tiny | 4 | eager | one device" in page
