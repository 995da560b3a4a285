"""Shared fixtures: example model files captured on the meta device."""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import pytest
import torch

from planner.ir.capture import capture
from planner.ir.graph import OpGraph
from planner.ir.model_file import instantiate, load_model_file

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# Tests never read or write the user's profile cache.
os.environ["AUTOPLAN_CACHE_DIR"] = tempfile.mkdtemp(prefix="autoplan-test-cache-")


@functools.cache
def captured(name: str, batch_size: int = 4, tracer: str = "export", **model_args: object) -> OpGraph:
    """The OpGraph of ``examples/<name>.py`` (built on meta), cached across tests."""
    model_file = load_model_file(EXAMPLES / f"{name}.py")
    model, inputs = instantiate(model_file, batch_size=batch_size, model_args=dict(model_args))
    return capture(model, inputs, tracer=tracer)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
