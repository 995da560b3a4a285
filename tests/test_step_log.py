"""The step log's CSV and TensorBoard writers (:mod:`executors.training.train_log`), without processes.

* the CSV gets the header once and one row per logged step, and a second logger on the same file (a resumed
  run) appends rows without a second header;
* TensorBoard gets each number as a ``train/<name>`` scalar at its step, through ``SummaryWriter`` (a stand-in,
  and the real package's event files read back with its own ``EventAccumulator``: the ``logs`` extra, which CI
  installs); without the package ``--tensorboard`` is one line.
"""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from executors.training import train_log
from executors.training.train_log import StepLogger, Throughput
from planner.errors import AutoplanError

ESTIMATE = SimpleNamespace(step_time_s=0.5, mfu=0.25, memory_per_device_bytes=2**20)
PLAN = SimpleNamespace(estimate=ESTIMATE, cluster=SimpleNamespace(num_devices=2, device=SimpleNamespace(name="cpu")))
STEP = {"loss": 2.5, "step_time_s": 0.25, "lr": 1e-3, "grad_norm": 0.5}


def _logger(**keywords: object) -> StepLogger:
    throughput = Throughput(unit="tokens", per_step=1000)
    return StepLogger(PLAN, throughput=throughput, every=2, out=io.StringIO(), **keywords)


def test_csv_has_the_header_once_and_a_row_per_logged_step(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "steps.csv"
    first = _logger(csv_path=path)
    for step in range(3):  # every 2 steps and the last: steps 2 and 3
        first.log(step=step, last=step == 2, **STEP)
    _logger(csv_path=path).log(step=3, last=True, **STEP)  # a resumed run appends
    text = path.read_text()
    assert text.count("step,") == 1
    rows = list(csv.DictReader(io.StringIO(text)))
    assert [row["step"] for row in rows] == ["2", "3", "4"]
    assert float(rows[0]["tokens_per_s"]) == pytest.approx(4000.0) and rows[0]["memory_bytes"] == ""
    assert float(rows[0]["loss"]) == 2.5 and float(rows[0]["grad_norm"]) == 0.5


def test_tensorboard_gets_each_number_as_a_scalar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scalars: list[tuple[str, float, int]] = []

    class SummaryWriter:
        def __init__(self, log_dir: str) -> None:
            assert log_dir == str(tmp_path / "tb")

        def add_scalar(self, tag: str, value: float, global_step: int) -> None:
            scalars.append((tag, value, global_step))

        def flush(self) -> None:
            pass

    stand_in = ModuleType("torch.utils.tensorboard")
    stand_in.SummaryWriter = SummaryWriter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", stand_in)
    monkeypatch.setattr(train_log, "check_tensorboard", lambda: None)
    _logger(tensorboard_dir=tmp_path / "tb").log(step=0, last=True, **STEP)
    assert ("train/loss", 2.5, 1) in scalars and ("train/tokens_per_s", 4000.0, 1) in scalars
    assert not any(tag == "train/memory_bytes" for tag, _, _ in scalars)  # not measured: no scalar


def test_tensorboard_without_the_package_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(train_log.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(AutoplanError, match=r"^--tensorboard needs the tensorboard package.*pip install tensorboard$"):
        train_log.check_tensorboard()


def test_tensorboard_event_files_hold_the_scalars(tmp_path: Path) -> None:
    """The real writer: the event files TensorBoard itself reads back hold every logged number at its step."""
    pytest.importorskip("tensorboard", reason="the `logs` extra (pip install -e '.[logs]') is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = _logger(tensorboard_dir=tmp_path / "tb")
    for step in range(4):  # every 2 steps: steps 2 and 4
        logger.log(step=step, last=step == 3, **{**STEP, "loss": 2.5 - step})
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert "train/loss" in events.Tags()["scalars"] and "train/memory_bytes" not in events.Tags()["scalars"]
    loss = [(event.step, event.value) for event in events.Scalars("train/loss")]
    assert loss == [(2, pytest.approx(1.5)), (4, pytest.approx(-0.5))]
    assert [event.value for event in events.Scalars("train/tokens_per_s")] == pytest.approx([4000.0, 4000.0])
