"""Calibrations cached per machine, so planning for the machine you are on starts calibrated.

``plan`` on ``--cluster local-cpu`` (this machine's CPU processes) reads the calibration cached for this machine
and that many processes (:func:`load_calibrated`); without one it runs ``plan calibrate --quick`` once and caches
the result (:func:`save_calibrated`, ``calibration.machine.planning_cluster``). ``plan tune`` writes what it
learned (:mod:`cost_models.corrections`) into the same entry, so the next ``plan`` starts closer.

An entry is a cluster file (what ``plan calibrate`` writes) at
``$AUTOPLAN_CACHE_DIR/calibration/<name>-w<processes>-<machine key>.json`` (else ``~/.cache/autoplan/...``), the
machine key a hash of the host name, the CPU model, the core count and the torch version
(:func:`machine_key`): another machine, or this one after a torch upgrade, calibrates again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
from pathlib import Path
from typing import Any

from cost_models.cluster import Cluster
from cost_models.profiling.profiler import CACHE_DIR_ENV
from planner.atomic_file import write_text_atomic


def machine_key() -> str:
    """A short hash of what makes a calibration this machine's: host, CPU model, core count, torch version."""
    import torch

    parts = (socket.gethostname(), platform.processor() or platform.machine(), str(os.cpu_count()), torch.__version__)
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]


def calibration_path(name: str, *, processes: int) -> Path:
    directory = os.environ.get(CACHE_DIR_ENV)
    root = Path(directory) if directory else Path.home() / ".cache" / "autoplan"
    safe = "".join(char if char.isalnum() or char in "-." else "-" for char in name)
    return root / "calibration" / f"{safe}-w{processes}-{machine_key()}.json"


def load_calibrated(name: str, *, processes: int) -> Cluster | None:
    """The cached calibration of cluster ``name`` for ``processes`` processes on this machine, or None."""
    path = calibration_path(name, processes=processes)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return Cluster.from_json(data, source=str(path))
    except (ValueError, OSError):
        return None  # an unreadable entry is calibrated again


def save_calibrated(data: dict[str, Any], name: str, *, processes: int) -> Path:
    """Cache a cluster file's fields (checked to load back) as the calibration of ``name`` here."""
    path = calibration_path(name, processes=processes)
    text = json.dumps(data, indent=2) + "\n"
    Cluster.from_json(json.loads(text), source=str(path))  # never cache what would not load back
    write_text_atomic(path, text, what="calibration cache")
    return path
