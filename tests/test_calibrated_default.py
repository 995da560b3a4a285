"""Planning for the machine you are on starts calibrated: local-cpu is calibrated once, cached, and said so."""

from __future__ import annotations

from pathlib import Path

import pytest

from calibration.machine import planning_cluster
from cost_models.cluster import preset
from planner.plan.report import figures_text


class _FakeCalibration:
    """What calibrate_machine returns, without the minute of measuring: the preset's figures, marked measured."""

    def to_json(self) -> dict:
        data = preset("local-cpu").to_json()
        data["device"]["peak_flops"] = {"float32": 123e9, "bfloat16": 123e9}
        data["calibration"] = {"by": "plan calibrate", "date": "2026-11-26", "num_processes": 2}
        return data


@pytest.fixture
def calibrations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("AUTOPLAN_CALIBRATE", "1")
    runs: list[dict] = []

    def calibrate_machine(**kwargs) -> _FakeCalibration:
        runs.append(kwargs)
        return _FakeCalibration()

    monkeypatch.setattr("calibration.machine.calibrate_machine", calibrate_machine)
    return runs


def test_local_cpu_is_calibrated_once_and_then_read_from_the_cache(calibrations: list[dict]) -> None:
    said: list[str] = []
    first = planning_cluster("local-cpu", num_nodes=None, devices_per_node=2, calibrate=True, say=said.append)
    assert len(calibrations) == 1 and calibrations[0]["num_processes"] == 2 and calibrations[0]["quick"]
    assert len(said) == 1 and "calibrating this machine for 2 processes, once" in said[0] and "\n" not in said[0]
    second = planning_cluster("local-cpu", num_nodes=None, devices_per_node=2, calibrate=True, say=said.append)
    assert len(calibrations) == 1 and len(said) == 1  # read from the cache, silently
    for cluster in (first, second):
        assert cluster.name == "local-cpu" and cluster.device.peak_flops["float32"] == 123e9
        assert figures_text(cluster).startswith("calibrated: measured on this machine by plan calibrate")
    planning_cluster("local-cpu", num_nodes=None, devices_per_node=4, calibrate=True, say=said.append)
    assert len(calibrations) == 2  # another process count is another calibration


def test_no_calibrate_and_other_clusters_keep_their_figures(calibrations: list[dict]) -> None:
    rough = planning_cluster("local-cpu", num_nodes=None, devices_per_node=2, calibrate=False, say=print)
    assert rough.calibration is None and "uncalibrated" in figures_text(rough)
    gpu = planning_cluster("dgx-a100", num_nodes=None, devices_per_node=None, calibrate=True, say=print)
    assert gpu.calibration is None and figures_text(gpu).startswith("data-sheet figures")
    assert calibrations == []
