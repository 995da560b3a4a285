"""The best MFU published for a GPU and model size: the table's lookups, and the note an estimate above it gets."""

from __future__ import annotations

import itertools

import pytest

from cost_models.mfu_bounds import PUBLISHED_MFU, mfu_bound_note, published_bound


def test_each_gpu_and_size_has_one_bound() -> None:
    for gpu in ("A100", "H100", "V100"):
        rows = sorted((b for b in PUBLISHED_MFU if b.gpu == gpu), key=lambda b: b.min_params)
        assert rows[0].min_params == 0 and rows[-1].max_params == float("inf")
        assert all(a.max_params == b.min_params for a, b in itertools.pairwise(rows))  # no gap, no overlap
        assert all(0 < b.mfu < 1 for b in rows)
    assert published_bound("A100-SXM-80GB", 6.7e9).mfu == pytest.approx(0.6423)  # MPT-7B, FSDP on 8 A100s
    assert published_bound("A100-SXM-80GB", 1.3e9).mfu == pytest.approx(0.6068)  # MPT-1B
    assert published_bound("H100-SXM-80GB", 175e9).mfu == pytest.approx(0.48)  # Megatron-LM's README
    assert published_bound("cpu", 1e9) is None


def test_an_estimate_above_the_best_published_says_so_with_the_reason() -> None:
    note = mfu_bound_note(device_name="A100-SXM-80GB", num_params=6.7e9, mfu=0.72, gemm_efficiency=0.87)
    assert note is not None and note.startswith("estimated MFU 72% is above the best published for A100")
    assert "64.2%, MPT-7B" in note and "likely optimistic" in note and "87% of peak" in note
    assert mfu_bound_note(device_name="A100-SXM-80GB", num_params=6.7e9, mfu=0.60, gemm_efficiency=0.87) is None
    assert mfu_bound_note(device_name="cpu", num_params=6.7e9, mfu=0.99, gemm_efficiency=None) is None


def test_a_plan_above_the_bound_carries_the_note() -> None:
    """A two-layer GPT-1.3B (0.31B parameters), data parallel on 8 A100s: the note exactly when the estimate's MFU is
    above the bound (58% against MPT-125M's 54.1% when written)."""
    from cost_models.cluster import load_cluster
    from planner.api import plan_model_file
    from tests.conftest import EXAMPLES

    plan = plan_model_file(
        EXAMPLES / "gpt.py",
        load_cluster("dgx-a100"),
        batch_size=64,
        method="data-parallel",
        model_args={"size": "1.3b", "layers": 2},
    )
    bound = published_bound(plan.cluster.device.name, plan.model.num_params)
    noted = any(note.startswith("estimated MFU") for note in plan.notes)
    assert noted == (plan.estimate.mfu > bound.mfu)
    assert not noted or any(bound.source in note for note in plan.notes)
